"""fsdptrain: an FSDP2-native trainer for supervised fine-tuning and GRPO of causal language models."""
