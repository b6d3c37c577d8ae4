"""Accuracy of a Hugging Face model folder on an RL parquet file, scored by the trainer's own reward functions.

    python -m fsdptrain.evaluate MODEL_DIR DATA.parquet [--backend hf|vllm] [--n 1] [--temperature 0] [--max-new-tokens 256]
        [--batch-size 16] [--seed 0] [--out results.jsonl] [--summary summary.json] [--tool-config tools.yaml [--max-turns N]]
        [custom_reward_function.path=F custom_reward_function.name=N]
        [data.apply_chat_template_kwargs='{enable_thinking: false}']

Greedy by default (`--temperature T` samples, `--n` responses per prompt). Per data_source: accuracy with its
binomial standard error, mean score, mean response length in tokens, and how many responses hit
--max-new-tokens without ending. `--out` writes one JSON line per response (prompt, response, scores).
With `--tool-config` (verl's tool YAML) the model answers over several turns, calling those tools, within
--max-new-tokens in all, as the GRPO trainer's multi-turn rollouts do. A vision-language model reads each row's
images (the `images` column, verl's layout) on the hf backend.

Recommendation (MiniOneRec's evaluation): `--beams K [--catalog ITEMS]` answers each prompt with its K beams, best
first, constrained to the catalog's items (rl/rollout/beams.py; the hf backend), and prints HR@K and NDCG@K (one
relevant item: the row's ground truth) for K in 1, 5, 10 up to the beams, with standard errors over the prompts
(each response scored by the item_rule verifier unless custom_reward_function.path is given);
`--paired-with OTHER.jsonl` (another model's --out on the same file) adds this model's paired differences.
"""

import argparse
import json

import torch
import transformers
import yaml
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from fsdptrain.data.images import image_reader
from fsdptrain.dtypes import DTYPES, compute_dtype, warn_if_emulated
from fsdptrain.rl.agent.loop import AGENT_LOOPS, LoopContext, MultiTurnSettings
from fsdptrain.rl.agent.tools import load_tools, tool_schemas
from fsdptrain.rl.data import load_prompts
from fsdptrain.rl.rewards import VERIFIERS, load_reward_function, score_responses
from fsdptrain.rl.rollout import ROLLOUT_ENGINES, build_rollout
from fsdptrain.rl.rollout.base import EnginePlacement, EngineSpec, RolloutEngine, engine_settings
from fsdptrain.rl.sampling import RolloutRequest, local_answers
from fsdptrain.rl.validation import RANKING_KS, evaluate, mean_and_se, ranking_values, summarize


def build_engine(backend: str, model_dir: str, tokenizer: PreTrainedTokenizerBase, max_model_len: int, seed: int, device: torch.device,
                 dtype: torch.dtype, beams: bool = False, catalog: str | None = None) -> RolloutEngine:
    """One process's engine `backend` (a registered rollout engine) on `device`, with its own settings' defaults
    but for `beams` (its beam search) and `catalog` (its responses constrained to the catalog's items); an engine
    that sizes its memory takes a share that leaves the host or GPU room for more."""
    info = ROLLOUT_ENGINES.info[backend]
    wanted = {"beam_search": beams, "catalog_file": catalog, "gpu_memory_utilization": 0.5 if device.type == "cuda" else 0.1}
    settings = info.check(engine_settings(info, wanted), EnginePlacement(device, engines_on_host=1))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    spec = EngineSpec(model_dir, dtype, device, pad, trust_remote_code=False, max_model_len=max_model_len, seed=seed, tensor_parallel_size=1,
                      free_cache_engine=False, settings=settings, distributed=False)
    return build_rollout(backend, spec)


def parse_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], dict[str, str | None]]:
    """The flags, the data files, and the trainer keys given as key=value."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("data", nargs="+", help="RL parquet file(s) in verl's layout")
    parser.add_argument("--backend", choices=list(ROLLOUT_ENGINES), default="hf", help="the rollout engine: hf (transformers), or vllm where installed")
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
    parser.add_argument("--beams", type=int, help="answer with this many beams, best first, and report HR@K and NDCG@K")
    parser.add_argument("--catalog", help="with --beams: constrain every response to this file's items (a MiniOneRec index, or one a line)")
    parser.add_argument("--paired-with", help="with --beams: another model's --out on the same prompts, for paired differences")
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
    if args.beams is not None and (args.beams < 1 or not ROLLOUT_ENGINES.info[args.backend].beams or args.tool_config):
        parser.error(f"--beams must be >= 1, on a backend with beam search ({', '.join(ROLLOUT_ENGINES.names(beams=True))}), without --tool-config")
    if (args.catalog or args.paired_with) and args.beams is None:
        parser.error("--catalog and --paired-with go with --beams")
    return args, files, keys


def main(argv: list[str] | None = None) -> None:
    args, files, keys = parse_arguments(argv)
    reward_fn = load_reward_function(keys["custom_reward_function.path"], keys["custom_reward_function.name"])
    if args.beams is not None and not keys["custom_reward_function.path"]:
        reward_fn = VERIFIERS["item_rule"]  # a recommendation's answer is right when it is the row's item
    transformers.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template_kwargs = yaml.safe_load(keys["data.apply_chat_template_kwargs"]) or {}
    tools = load_tools(args.tool_config, "--tool-config") if args.tool_config else {}
    config = AutoConfig.from_pretrained(args.model_dir)
    images = image_reader(args.model_dir, "MODEL_DIR", "images", tokenizer, config, trust_remote_code=False)
    if images is not None and not ROLLOUT_ENGINES.info[args.backend].images:
        raise SystemExit(f"{args.model_dir} is a vision-language model ({config.model_type}): its images are read by the "
                         f"{', '.join(ROLLOUT_ENGINES.names(images=True))} backend")
    prompts = load_prompts(files, tokenizer, template_kwargs, tool_schemas(tools), images)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warn_if_emulated(args.dtype, "--dtype", device)
    engine = build_engine(args.backend, args.model_dir, tokenizer, max(len(p.ids) for p in prompts) + args.max_new_tokens, args.seed,
                          device, compute_dtype(args.dtype, device), args.beams is not None, args.catalog)
    settings = MultiTurnSettings(args.max_turns, max_user_turns=None, max_parallel_calls=1, max_tool_response_length=256,
                                 tool_response_truncate_side="middle", format="hermes", tokenization_sanity_check_mode="disable", tool_timeout_s=30.0)
    name = "tool_agent" if tools else "single_turn_agent"  # every prompt is answered by the loop the flags give
    for prompt in prompts:
        prompt.agent_name = name
    loops = {name: AGENT_LOOPS[name](LoopContext(engine, tokenizer, settings if tools else None, tools, {}, template_kwargs, images))}
    request = RolloutRequest(args.beams or args.n, args.max_new_tokens, args.batch_size, args.temperature or 1.0, top_p=1.0, top_k=-1,
                             do_sample=args.temperature > 0, calculate_log_probs=False)
    score = lambda responses, prompts, ids: score_responses(reward_fn, tokenizer, prompts, responses, ids, "")  # noqa: E731
    records = evaluate(local_answers(engine, loops), prompts, score, request)
    report(records, args.out, args.summary)
    if args.beams is not None:
        report_ranking(records, [k for k in RANKING_KS if k <= args.beams], args.paired_with)


def report_ranking(records: list[dict], ks: list[int], paired_with: str | None) -> None:
    """HR@K and NDCG@K with their standard errors; with `paired_with` (another model's records of the same prompts),
    this model's mean difference from it and its paired standard error."""
    values = ranking_values(records, ks)
    other = None
    if paired_with:
        with open(paired_with) as f:
            other = ranking_values([json.loads(line) for line in f], ks)
        if set(other) != set(values):
            raise SystemExit(f"--paired-with {paired_with}: its prompts are not these ({len(other)} vs {len(values)})")
    print(f"\n{'metric':<8} {'mean':>7} {'± se':>7}" + (f" {'- other':>8} {'± se':>7}" if other else ""))
    for name in next(iter(values.values())):
        mean, se = mean_and_se([v[name] for v in values.values()])
        line = f"{name:<8} {mean:>7.4f} {se:>7.4f}"
        if other:
            gain, gain_se = mean_and_se([values[i][name] - other[i][name] for i in values])
            line += f" {gain:>+8.4f} {gain_se:>7.4f}"
        print(line)


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
