"""Interactions with verl's interface (the simulated user or environment that answers an assistant turn without a
tool call), the interaction YAML that lists them, and the adapter that makes any gym-style environment one.

An interaction is chosen per row by `extra_info.interaction_kwargs.name`; those kwargs go to every call.
`generate_response(instance_id, messages, **kwargs) -> (should_terminate, text, turn_score, metrics)`: the text
becomes the next user message, the score is kept in the trajectory's `turn_scores` for the reward function.
"""

from collections.abc import Sequence
from typing import Any
from uuid import uuid4

from fsdptrain.errors import ConfigError
from fsdptrain.rl.agent.tools import import_class, read_yaml_list
from fsdptrain.rl.data import Prompt


class BaseInteraction:
    def __init__(self, config: dict):
        self.config = config
        self.name = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        pass


def load_interactions(path: str, key: str = "actor_rollout_ref.rollout.multi_turn.interaction_config_path") -> dict[str, BaseInteraction]:
    """The interactions of verl's interaction YAML (`interaction: [{name, class_name, config}]`), by name."""
    interactions = {}
    for i, entry in enumerate(read_yaml_list(path, "interaction", key)):
        name = entry.get("name") or entry["class_name"].rsplit(".", 1)[-1]
        try:
            interaction = import_class(entry["class_name"], f"{key} interaction[{i}]")({**(entry.get("config") or {}), "name": name})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}={path!r} interaction[{i}] ({entry['class_name']}): {e}") from None
        if name in interactions:
            raise ConfigError(f"{key}={path!r}: two interactions are named {name!r}")
        interactions[name] = interaction
    return interactions


def check_interaction_names(prompts: Sequence[Prompt], interactions: dict[str, BaseInteraction], source: str) -> None:
    """Every row's `extra_info.interaction_kwargs.name` names an interaction (a row without one takes the only
    interaction there is); an error names the file's key and the row."""
    for row, prompt in enumerate(prompts):
        kwargs = prompt.extra_info.get("interaction_kwargs")
        if not kwargs:
            continue
        if "name" not in kwargs and len(interactions) == 1:
            kwargs["name"] = next(iter(interactions))
        if kwargs.get("name") not in interactions:
            raise ConfigError(f"{source} row {row}: extra_info.interaction_kwargs.name={kwargs.get('name')!r} names no interaction of "
                              f"actor_rollout_ref.rollout.multi_turn.interaction_config_path (it has {sorted(interactions)})")


class EnvironmentInteraction(BaseInteraction):
    """Any gym-style environment as an interaction: `reset(seed) -> (observation, info)` when the trajectory
    starts, `step(action_text) -> (observation, reward, terminated, truncated, info)` on each assistant turn, the
    observation as the next user message and the reward as the turn's score. The rows' `interaction_kwargs.seed`
    resets the environment: the `rollout.n` trajectories of a row share it (ROLL's environment groups), and the
    row's prompt shows the observation that reset gives (the data script renders it).

    config: `env` (the environment's class, dotted), `env_config` (its keyword arguments), `max_steps` (the
    actions a trajectory may take, ROLL's max_actions_per_traj; none: the environment decides)."""

    def __init__(self, config: dict):
        super().__init__(config)
        if not config.get("env"):
            raise ValueError("an EnvironmentInteraction's config needs `env`: the environment's class")
        self.env_class = import_class(config["env"], f"interaction {self.name!r} config.env")
        self.env_config = dict(config.get("env_config") or {})
        self.max_steps = config.get("max_steps")
        self.episodes: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, seed: int | None = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid4())
        env = self.env_class(**self.env_config)
        env.reset(seed=seed)
        self.episodes[instance_id] = {"env": env, "steps": 0, "return": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        episode = self.episodes[instance_id]
        observation, reward, terminated, truncated, info = episode["env"].step(messages[-1]["content"])
        episode["steps"] += 1
        episode["return"] += float(reward)
        out_of_steps = self.max_steps is not None and episode["steps"] >= self.max_steps
        return bool(terminated or truncated or out_of_steps), str(observation), float(reward), dict(info or {})

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return self.episodes[instance_id]["return"]

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self.episodes.pop(instance_id, None)
