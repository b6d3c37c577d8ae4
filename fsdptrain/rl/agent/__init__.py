"""Multi-turn agentic rollouts on the rollout contract (rl/rollout/base.py): the loop over live trajectories
(loop.py), tool calls parsed from the model's text (tool_calls.py), tools (tools.py), interactions and gym-style
environments (interactions.py, sokoban.py), and the chat template's rendering of what is appended (templates.py).
"""
