"""A reward server: a rule function or a reward model over HTTP, for GRPO's `reward_model.remote_rm_url`.

    python -m fsdptrain.reward_server (--function FILE[:NAME] | --builtin gsm8k | --model DIR) [--host 127.0.0.1] [--port 8000]

It speaks OpenRLHF's protocol, so either side works with the other's: POST /get_reward with JSON
`{"query": [prompt + response texts], "prompts": [prompt texts], "labels": [ground truths]}` answers
`{"rewards": [floats], "scores": [the same]}`. A rule function gets each response (the query after its prompt), its
label and `data_sources` (an optional list; default "remote"); a reward model (sequence classification, one label)
scores each whole query. Requests that arrive together are scored as one batch (up to `--max-batch` texts). It binds
to the loopback address unless told otherwise: put it on another machine with `--host 0.0.0.0` and point the trainer
at `http://HOST:PORT/get_reward`.
"""

import argparse
import asyncio
import math
from collections.abc import Callable, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fsdptrain.rl.rewards import VERIFIERS, load_reward_function, score_sample

Scorer = Callable[[list[str], list[str], list, list[str]], list[float]]


def function_scorer(fn) -> Scorer:
    def score(queries: list[str], prompts: list[str], labels: list, sources: list[str]) -> list[float]:
        return [score_sample(fn, source, query[len(prompt):] if query.startswith(prompt) else query, label, None, f"request text {i}")["score"]
                for i, (query, prompt, label, source) in enumerate(zip(queries, prompts, labels, sources))]

    return score


def model_scorer(path: str) -> Scorer:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    model.config.pad_token_id = tokenizer.pad_token_id  # where its pooling finds each text's last token

    @torch.no_grad()
    def score(queries: list[str], prompts: list[str], labels: list, sources: list[str]) -> list[float]:
        inputs = tokenizer(queries, return_tensors="pt", padding=True, add_special_tokens=False)
        return model(**inputs).logits[:, 0].tolist()

    return score


class Batcher:
    """Scores the texts of requests that wait together as one batch, in a worker thread (the event loop keeps
    accepting requests meanwhile)."""

    def __init__(self, score: Scorer, max_batch: int):
        self.score, self.max_batch = score, max_batch
        self.queue: asyncio.Queue | None = None

    async def submit(self, texts: tuple[list, list, list, list]) -> list[float]:
        if self.queue is None:
            self.queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self.run())
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((texts, done))
        return await done

    async def run(self) -> None:
        while True:
            waiting = [await self.queue.get()]
            while not self.queue.empty() and sum(len(t[0]) for t, _ in waiting) < self.max_batch:
                waiting.append(self.queue.get_nowait())
            columns = [sum((list(t[k]) for t, _ in waiting), []) for k in range(4)]
            try:
                scores = await asyncio.to_thread(self.score, *columns)
            except Exception as e:  # every waiting request gets the error, the server goes on
                for _, done in waiting:
                    done.set_exception(e)
                continue
            start = 0
            for texts, done in waiting:
                done.set_result(scores[start : start + len(texts[0])])
                start += len(texts[0])


def app(score: Scorer, max_batch: int = 64) -> Starlette:
    batcher = Batcher(score, max_batch)

    async def get_reward(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            queries = list(body["query"])
            prompts = list(body.get("prompts") or [""] * len(queries))
            labels = list(body.get("labels") or [None] * len(queries))
            sources = list(body.get("data_sources") or ["remote"] * len(queries))
            if not len(queries) == len(prompts) == len(labels) == len(sources):
                raise ValueError("query, prompts, labels and data_sources differ in length")
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": f"bad request: {e}"}, status_code=400)
        try:
            rewards = await batcher.submit((queries, prompts, labels, sources))
        except Exception as e:
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        if not all(math.isfinite(r) for r in rewards):
            return JSONResponse({"error": "a reward is not finite"}, status_code=500)
        return JSONResponse({"rewards": rewards, "scores": rewards})

    return Starlette(routes=[Route("/get_reward", get_reward, methods=["POST"])])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--function", help="FILE[:NAME]: compute_score (or NAME) of a Python file, verl's signature")
    source.add_argument("--builtin", choices=sorted(VERIFIERS), help="a built-in verifier")
    source.add_argument("--model", help="a sequence-classification model folder (one label)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=64, help="texts scored together at most")
    args = parser.parse_args(argv)
    if args.model:
        score = model_scorer(args.model)
    elif args.builtin:
        score = function_scorer(VERIFIERS[args.builtin])
    else:
        path, _, name = args.function.partition(":")
        score = function_scorer(load_reward_function(path, name or None, "--function"))
    uvicorn.run(app(score, args.max_batch), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
