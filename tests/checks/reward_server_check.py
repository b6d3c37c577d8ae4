"""Run by test_remote_reward.py: fsdptrain's reward server on the loopback address for a rule file, which exits
(as a crashed server does) once it has answered `--die-after` requests, if given.

    python -m tests.checks.reward_server_check REWARD_FILE PORT [--die-after N]
"""

import argparse
import os

import uvicorn

from fsdptrain.reward_server import app, function_scorer
from fsdptrain.rl.rewards import load_reward_function


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("reward_file")
    parser.add_argument("port", type=int)
    parser.add_argument("--die-after", type=int)
    args = parser.parse_args()
    inner = app(function_scorer(load_reward_function(args.reward_file, None)))
    answered = 0

    async def dying(scope, receive, send):
        nonlocal answered
        if scope["type"] == "http" and args.die_after is not None and answered >= args.die_after:
            os._exit(1)
        await inner(scope, receive, send)
        if scope["type"] == "http":
            answered += 1

    uvicorn.run(dying, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
