"""trainer.best_model: the model of least validation loss kept as a Hugging Face folder, and training stopped once
that loss stops falling, as TRL users have them from transformers' Trainer (`load_best_model_at_end`,
`EarlyStoppingCallback`). Its state goes into each checkpoint, so that a resumed run counts on from where it was."""

import math
from typing import Any

from fsdptrain.config.sft import BestModelConfig


class BestModel:
    def __init__(self, config: BestModelConfig):
        self.config = config
        self.loss = math.inf
        self.step: int | None = None
        self.waited = 0  # validations since the loss last fell by more than the threshold

    def observe(self, step: int, loss: float) -> bool:
        """Record `step`'s validation loss; whether it is the best so far (by more than the threshold)."""
        if loss < self.loss - self.config.early_stopping_threshold:
            self.loss, self.step, self.waited = loss, step, 0
            return True
        self.waited += 1
        return False

    @property
    def stops(self) -> bool:
        patience = self.config.early_stopping_patience
        return patience is not None and self.waited >= patience

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "step": self.step, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss, self.step, self.waited = state["loss"], state["step"], state["waited"]
