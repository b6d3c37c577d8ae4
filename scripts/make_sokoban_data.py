"""Sokoban rooms as RL parquet files for multi-turn GRPO through an environment interaction.

    python scripts/make_sokoban_data.py OUT_DIR [--train 256] [--val 32] [--size 6] [--boxes 1] [--max-steps 10] [--seed 0]

Each row is one room, by its seed: the prompt holds the instructions and the board that `Sokoban.reset(seed)`
gives, `extra_info.interaction_kwargs` names the interaction and the seed (so that every trajectory of the row
plays the same room), and the ground truth is the word `solved` (the reward is the environment's: reward.sources
with the `turn_scores` verifier). Writes rl_train.parquet, rl_val.parquet and sokoban_interaction.yaml, the
interaction YAML for actor_rollout_ref.rollout.multi_turn.interaction_config_path.
"""

import argparse
import os

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from fsdptrain.rl.agent.sokoban import INSTRUCTIONS, Sokoban


def rows(seeds: range, size: int, boxes: int) -> list[dict]:
    out = []
    for seed in seeds:
        board = Sokoban(size=size, boxes=boxes).reset(seed=seed)[0]
        out.append({"prompt": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": f"{board}\nYour move?"}],
                    "data_source": "sokoban", "reward_model": {"ground_truth": "solved", "style": "environment"},
                    "extra_info": {"interaction_kwargs": {"name": "sokoban", "seed": seed}}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--size", type=int, default=6)
    parser.add_argument("--boxes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=10, help="actions a trajectory may take (ROLL's max_actions_per_traj)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    first = args.seed * 1_000_000
    for split, seeds in (("train", range(first, first + args.train)), ("val", range(first + args.train, first + args.train + args.val))):
        pq.write_table(pa.Table.from_pylist(rows(seeds, args.size, args.boxes)), os.path.join(args.out, f"rl_{split}.parquet"))
    interaction = {"interaction": [{"name": "sokoban", "class_name": "fsdptrain.rl.agent.interactions.EnvironmentInteraction",
                                    "config": {"env": "fsdptrain.rl.agent.sokoban.Sokoban", "max_steps": args.max_steps,
                                               "env_config": {"size": args.size, "boxes": args.boxes}}}]}
    with open(os.path.join(args.out, "sokoban_interaction.yaml"), "w") as f:
        yaml.safe_dump(interaction, f, sort_keys=False)
    print(f"wrote {args.train} + {args.val} rooms to {args.out}")


if __name__ == "__main__":
    main()
