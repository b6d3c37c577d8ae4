"""Accuracy of a Hugging Face model folder on an RL parquet file, scored by the trainer's own reward functions.

    python -m fsdptrain.evaluate MODEL_DIR DATA.parquet [--backend hf|vllm] [--n 1] [--temperature 0] [--max-new-tokens 256]
        [--batch-size 16] [--seed 0] [--out results.jsonl] [--summary summary.json] [--tool-config tools.yaml [--max-turns N]]
        [custom_reward_function.path=F custom_reward_function.name=N]
        [data.apply_chat_template_kwargs='{enable_thinking: false}']

Greedy by default (`--temperature T` samples, `--n` responses per prompt). Per data_source: accuracy with its
binomial standard error, mean score, mean response length in tokens, and how many responses hit
--max-new-tokens without ending. `--out` writes one JSON line per response (prompt, response, scores).
With `--tool-config` (verl's tool YAML) the model answers over several turns, calling those tools, within
--max-new-tokens in all, as the GRPO trainer's multi-turn rollouts do.
"""

import argparse
import json

import torch
import transformers
import yaml
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fsdptrain.dtypes import DTYPES, compute_dtype, warn_if_emulated
from fsdptrain.rl.agent.loop import AGENT_LOOPS, LoopContext, MultiTurnSettings
from fsdptrain.rl.agent.tools import load_tools, tool_schemas
from fsdptrain.rl.data import load_prompts
from fsdptrain.rl.rewards import load_reward_function, score_responses
from fsdptrain.rl.rollout.base import RolloutEngine
from fsdptrain.rl.rollout.hf import HFRollout
from fsdptrain.rl.sampling import RolloutRequest
from fsdptrain.rl.validation import evaluate, summarize


def build_engine(backend: str, model_dir: str, tokenizer: PreTrainedTokenizerBase, max_model_len: int, seed: int, device: torch.device,
                 dtype: torch.dtype) -> RolloutEngine:
    """One process's engine on `device`: transformers' generate, or vLLM (`backend`)."""
    if backend == "vllm":
        from fsdptrain.rl.rollout.vllm import EngineSettings, VLLMRollout

        settings = EngineSettings(gpu_memory_utilization=0.5 if device.type == "cuda" else 0.1, max_num_seqs=256, max_num_batched_tokens=8192,
                                  enable_chunked_prefill=True, enforce_eager=True, load_format="auto")
        return VLLMRollout(model_dir, dtype, max_model_len, seed, settings, distributed=False, free_cache_engine=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFRollout(model_dir, device, dtype, pad, free_cache_engine=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("data", nargs="+", help="RL parquet file(s) in verl's layout")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="transformers generate, or vLLM where installed")
    parser.add_argument("--n", type=int, default=1, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="the model's compute dtype (default: bf16 on a GPU, fp32 on CPU)")
    parser.add_argument("--out", help="JSONL of every prompt, response and score")
    parser.add_argument("--summary", help="JSON of the per-data_source figures printed in the table")
    parser.add_argument("--tool-config", help="verl's tool YAML: answer over several turns with these tools")
    parser.add_argument("--max-turns", type=int, help="assistant turns at most, with --tool-config (default: as the budget holds)")
    args = parser.parse_intermixed_args(argv)
    keys = {"custom_reward_function.path": None, "custom_reward_function.name": None, "data.apply_chat_template_kwargs": "{}"}
    files = []
    for item in args.data:
        key, sep, value = item.partition("=")
        if sep and key in keys:
            keys[key] = value
        elif sep:
            parser.error(f"unknown key {key!r} (known: {', '.join(keys)})")
        else:
            files.append(item)
    if not files:
        parser.error("no data file given")
    if args.n < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        parser.error("--n, --max-new-tokens and --batch-size must be >= 1")
    reward_fn = load_reward_function(keys["custom_reward_function.path"], keys["custom_reward_function.name"])
    transformers.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template_kwargs = yaml.safe_load(keys["data.apply_chat_template_kwargs"]) or {}
    tools = load_tools(args.tool_config, "--tool-config") if args.tool_config else {}
    prompts = load_prompts(files, tokenizer, template_kwargs, tool_schemas(tools))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warn_if_emulated(args.dtype, "--dtype", device)
    engine = build_engine(args.backend, args.model_dir, tokenizer, max(len(p.ids) for p in prompts) + args.max_new_tokens, args.seed,
                          device, compute_dtype(args.dtype, device))
    settings = MultiTurnSettings(args.max_turns, max_user_turns=None, max_parallel_calls=1, max_tool_response_length=256,
                                 tool_response_truncate_side="middle", format="hermes", tokenization_sanity_check_mode="disable", tool_timeout_s=30.0)
    name = "tool_agent" if tools else "single_turn_agent"  # every prompt is answered by the loop the flags give
    for prompt in prompts:
        prompt.agent_name = name
    loops = {name: AGENT_LOOPS[name](LoopContext(engine, tokenizer, settings if tools else None, tools, {}, template_kwargs))}
    request = RolloutRequest(args.n, args.max_new_tokens, args.batch_size, args.temperature or 1.0, top_p=1.0, top_k=-1,
                             do_sample=args.temperature > 0, calculate_log_probs=False)
    score = lambda responses, prompts, ids: score_responses(reward_fn, tokenizer, prompts, responses, ids, "")  # noqa: E731
    report(evaluate(engine, loops, prompts, score, request), args.out, args.summary)


def report(records: list[dict], out: str | None, summary_path: str | None) -> None:
    """The per-data_source table on the screen; the records as JSON lines at `out`, the table's figures as JSON at
    `summary_path`."""
    if out:
        with open(out, "w") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
    summary = summarize(records)
    print(f"{'data_source':<24} {'n':>6} {'acc':>7} {'± se':>7} {'score':>7} {'length':>7} {'truncated':>9}")
    for source, s in summary.items():
        print(f"{source:<24} {s['n']:>6} {s['acc']:>7.3f} {s['acc_se']:>7.3f} {s['score']:>7.3f} {s['response_length']:>7.1f} {s['truncated']:>9}")
    if summary_path:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
