"""verl's GSM8K answer tool (verl/tools/gsm8k_tool.py) as a verl user ports it: the same interface, imported from
fsdptrain. The model submits an answer; the tool keeps it, reads back the parsed answer and its reward, and costs
0.05 for a submission that does not improve on the last; its reward is the last answer's (GSM8K, flexible)."""

from uuid import uuid4

from fsdptrain.rl.agent.tools import BaseTool, OpenAIFunctionToolSchema
from fsdptrain.rl.rewards import gsm8k_score


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.instances: dict[str, dict] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid4())
        self.instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[str, float, dict]:
        answer = str(parameters.get("answer", ""))
        state = self.instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = await self.calc_reward(instance_id)
        penalty = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return f"Current parsed answer={answer!r} reward={reward}", penalty, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self.instances[instance_id]
        return gsm8k_score(state["response"], str(state["ground_truth"]), method="flexible")

    async def release(self, instance_id: str, **kwargs) -> None:
        self.instances.pop(instance_id, None)
