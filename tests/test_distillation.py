"""On-policy distillation (rl/distillation.py, rl/teacher.py): the loss against verl 0.9.1's own functions
(trainer/distillation/losses.py and its FSDP top-k kernel, from the unpacked wheel) on seeded cases; the policy's
log-probs of the teacher's top-k tokens through the chunked kernel against autograd on full logits; the teacher's
top-k against a plain transformers forward; the config's refusals; and runs on 2 processes whose held-out KL to
the teacher falls, measured by a plain transformers loop."""

import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fsdptrain.models.loss import chunked_token_log_probs, token_top_k
from fsdptrain.rl import core_algos
from fsdptrain.rl.distillation import TEACHER_LOG_PROB, TEACHER_TOPK_LOG_PROBS, DistillationSettings, distillation_loss

import make_tiny
from checks.verl_reference import load_verl
from conftest import REPO, grpo_config_problems, logged, save_tiny_model, torchrun

MODES = ["forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


class LossConfig(SimpleNamespace):
    """verl's DistillationLossConfig as its loss functions read it (attributes and `get`, as an omegaconf node)."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def verl_distillation_loss(mode: str, pg: bool, clamps: tuple, agg: str, logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_topk: torch.Tensor,
                           sampled: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor, k: int) -> torch.Tensor:
    """verl 0.9.1's `distillation_loss` on a padded batch (B, T): its FSDP top-k kernel fed nested tensors of the
    valid tokens as its teacher's server returns them, and its padding helper taken as the identity on tensors
    already padded (the only part of verl not run as it is)."""
    losses = load_verl("verl.trainer.distillation.losses")
    fsdp_losses = load_verl("verl.trainer.distillation.fsdp.losses")
    losses.no_padding_2_padding = lambda tensor, data: tensor
    max_clamp, min_clamp = clamps
    loss_config = LossConfig(loss_mode=mode, topk=k, loss_max_clamp=max_clamp, log_prob_min_clamp=min_clamp, use_policy_gradient=pg,
                             policy_loss_mode="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.3, global_batch_info={},
                             use_chunked_topk=False)
    distillation_config = SimpleNamespace(distillation_loss=loss_config)
    actor = SimpleNamespace(loss_agg_mode=agg, global_batch_info={}, loss_scale_factor=None, strategy="fsdp")
    log_softmax = logits.log_softmax(-1)
    log_probs = log_softmax.gather(-1, sampled[..., None])[..., 0]
    data = {"response_mask": mask, "dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "old_log_probs": old,
            "rollout_is_weights": is_weights}
    output = {"log_probs": log_probs}
    if mode == "forward_kl_topk":
        valid = mask.bool()
        nested = lambda x: torch.nested.nested_tensor([row[m] for row, m in zip(x, valid)], layout=torch.jagged)  # noqa: E731
        flat = fsdp_losses.compute_forward_kl_topk(logits[valid][None], nested(teacher_topk), nested(teacher_ids), distillation_config, "thd")
        for key in ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
            padded = torch.zeros(mask.shape, dtype=flat[key].dtype)
            padded[valid] = flat[key][0]
            output[key] = padded
    else:
        data["teacher_logprobs"] = teacher_topk[..., :1]  # the sampled token's, as the server returns it without top-k
    loss, _ = losses.distillation_loss(actor, distillation_config, output, data)
    return loss


def our_distillation_loss(mode: str, pg: bool, clamps: tuple, agg: str, logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_topk: torch.Tensor,
                          sampled: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor, k: int) -> torch.Tensor:
    settings = DistillationSettings(mode, k, use_task_rewards=False, coef=1.0, loss_max_clamp=clamps[0], log_prob_min_clamp=clamps[1],
                                    use_policy_gradient=pg, policy=core_algos.PolicyLossSettings(0.2, 0.3))
    rows, width = mask.shape
    flat_logits = logits.reshape(rows * width, -1)
    targets = torch.cat([sampled.reshape(-1, 1), teacher_ids.reshape(rows * width, k)], dim=1)
    both = chunked_token_log_probs(flat_logits, torch.eye(flat_logits.shape[1], dtype=flat_logits.dtype), targets, 1.0, 5, None)[0]  # the identity as output layer
    log_probs, student_topk = both[:, 0], both[:, 1:]
    flat_mask = mask.reshape(-1)
    sequence_tokens = mask.sum(-1, keepdim=True).expand_as(mask).reshape(-1)
    tokens = core_algos.PolicyTokens(log_probs, old.reshape(-1), torch.zeros_like(log_probs), flat_mask, lambda values: values, sequence_tokens)
    targets = {TEACHER_TOPK_LOG_PROBS: teacher_topk.reshape(rows * width, k), TEACHER_LOG_PROB: teacher_topk[..., 0].reshape(-1),
               "rollout_is_weight": is_weights.reshape(-1)}
    per_token = partial(core_algos.agg_loss, mask=flat_mask, sequence_tokens=sequence_tokens, mode=agg, global_tokens=float(mask.sum()),
                        global_sequences=float((mask.sum(-1) > 0).sum()), max_response_length=width)
    return distillation_loss(settings, tokens, student_topk if mode == "forward_kl_topk" else None, targets, per_token, {})


@pytest.mark.skipif(load_verl("verl.trainer.ppo.core_algos") is None, reason="verl 0.9.1's wheel is not unpacked (scripts/setup.sh test)")
@pytest.mark.parametrize("clamped", [False, True], ids=["free", "clamped"])
@pytest.mark.parametrize("pg", [False, True], ids=["supervised", "policy_gradient"])
@pytest.mark.parametrize("mode", MODES)
def test_the_distillation_loss_equals_verls(mode, pg, clamped):
    """Every loss mode verl registers, as a supervised loss and as the policy gradient's advantage (clipped, IS
    weights), with and without verl's clamps, on a seeded padded batch: the loss and its gradient in the
    logits equal verl 0.9.1's `distillation_loss` to 1e-6 (the teacher's log-probs drawn far enough apart for the
    clamps to bite)."""
    if mode == "k1" and not pg:
        pytest.skip("verl refuses k1 as a supervised loss (its gradient ignores the teacher); test_config_refusals checks ours")
    generator = torch.Generator().manual_seed(MODES.index(mode) * 4 + 2 * pg + clamped)
    rows, width, vocab, k = 3, 5, 11, 4
    logits = (torch.randn(rows, width, vocab, generator=generator, dtype=torch.float64) * 2)
    teacher_logits = torch.randn(rows, width, vocab, generator=generator, dtype=torch.float64) * 3
    sampled = torch.randint(vocab, (rows, width), generator=generator)
    teacher_log_softmax = teacher_logits.log_softmax(-1)
    if mode == "forward_kl_topk":
        teacher_topk, teacher_ids = teacher_log_softmax.topk(k, dim=-1)
    else:  # the estimators read the teacher's log-prob of the sampled token (column 0)
        teacher_ids = sampled[..., None].expand(rows, width, k).clone()
        teacher_topk = teacher_log_softmax.gather(-1, teacher_ids)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    old = logits.log_softmax(-1).gather(-1, sampled[..., None])[..., 0] + 0.3 * torch.randn(rows, width, generator=generator, dtype=torch.float64)
    is_weights = torch.rand(rows, width, generator=generator, dtype=torch.float64) + 0.5
    clamps = (0.5, -2.5) if clamped else (None, None)
    agg = "seq-mean-token-mean" if MODES.index(mode) % 2 else "token-mean"
    results = []
    for compute in (verl_distillation_loss, our_distillation_loss):
        leaf = logits.clone().requires_grad_()
        loss = compute(mode, pg, clamps, agg, leaf, teacher_ids, teacher_topk, sampled, old.clone(), mask, is_weights, k)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    (verl_loss, verl_grad), (loss, grad) = results
    assert abs(float(verl_loss)) > 1e-3 and verl_grad.abs().max() > 1e-4  # a case where something is at stake
    torch.testing.assert_close(loss, verl_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, verl_grad, rtol=1e-6, atol=1e-6)


def test_log_probs_of_other_tokens_through_the_chunked_kernel_equal_autograd():
    """The policy's log-probs of the sampled token and of K more tokens a position (the teacher's top-k) with the
    entropy, through the chunked kernel, and their gradients in the hidden states and the output layer under
    arbitrary upstream gradients, equal autograd through full fp64 logits (to fp32 precision)."""
    generator = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab, k = 13, 6, 17, 3
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    targets = torch.randint(vocab, (tokens, 1 + k), generator=generator)
    upstream = torch.randn(tokens, 1 + k, generator=generator, dtype=torch.float64)
    entropy_upstream = torch.randn(tokens, generator=generator, dtype=torch.float64)
    results = []
    for chunked in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if chunked:
            log_probs, entropy = chunked_token_log_probs(h, w, targets, 0.7, 4, "entropy")
        else:
            log_softmax = (h @ w.T / 0.7).log_softmax(-1)
            log_probs, entropy = log_softmax.gather(1, targets), -(log_softmax.exp() * log_softmax).sum(-1)
        ((log_probs * upstream).sum() + (entropy * entropy_upstream).sum()).backward()
        results.append((log_probs.detach(), entropy.detach(), h.grad, w.grad))
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours.to(reference.dtype), reference, rtol=1e-5, atol=1e-5)  # the kernel computes in fp32


def test_the_teachers_top_k_is_a_plain_forwards(tmp_path, tokenizer):
    """token_top_k on padded rows, chunked and through full logits, equals the top-k of a plain transformers
    forward's log-softmax at each labelled position, and leaves the others at 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "teacher", "llama", tokenizer, initializer_range=0.2))
    ids = torch.tensor([[5, 17, 42, 7, 8, 2], [11, 12, 13, 14, 0, 0]])
    attention = (torch.arange(6) < torch.tensor([[6], [4]])).long()
    labels = torch.where(attention.bool(), ids, -100).roll(-1, 1)
    labels[:, -1] = -100
    labels[:, :2] = -100  # the prompt's
    plain = model(input_ids=ids, attention_mask=attention).logits.float().log_softmax(-1).flatten(0, 1).topk(5, dim=-1)
    inputs = {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0)}
    kept = (labels.flatten() != -100)
    for chunk_tokens in (3, 0):
        values, top = token_top_k(model, inputs, labels, 5, chunk_tokens)
        torch.testing.assert_close(values[kept], plain.values[kept], rtol=1e-5, atol=1e-5)
        assert torch.equal(top[kept], plain.indices[kept]) and not values[~kept].any() and not top[~kept].any()


@pytest.mark.parametrize("overrides, message", [
    (["distillation.enabled=true"], "distillation.enabled=true needs distillation.teacher_models.teacher_model.model_path"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=t", "distillation.distillation_loss.loss_mode=k1"],
     "distillation.distillation_loss.loss_mode=k1 with distillation.distillation_loss.use_policy_gradient=false"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=t", "distillation.distillation_loss.loss_mode=jsd"],
     "distillation.distillation_loss.loss_mode"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=t", "distillation.distillation_loss.policy_loss_mode=gspo"],
     "distillation.distillation_loss.policy_loss_mode"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=t", "actor_rollout_ref.actor.skip_zero_advantage=true"],
     "the distillation loss trains every response"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=t", "distillation.distillation_loss.use_task_rewards=false",
      "algorithm.adv_estimator=gae"], "nothing uses the critic's values"),
])
def test_config_refusals(overrides, message):
    assert message in grpo_config_problems(*overrides)


def test_several_teachers_and_a_foreign_vocabulary_are_refused(tmp_path, tiny_llama, rl_data, capsys):
    """verl's multi-teacher keys are refused by name before any process starts; a teacher whose tokenizer differs
    from the policy's is refused by `check`, naming the key."""
    from fsdptrain.check import main as check_main
    from fsdptrain.config.verl_keys import translate

    from test_grpo import grpo_args

    _, problems = translate(["+distillation.teacher_models.teacher_model2.model_path=/t"], "grpo", 2)
    assert problems and "several teachers" in problems[0], problems
    teacher, vocabulary = tmp_path / "teacher", make_tiny.trained_tokenizer()
    make_tiny.tiny_model("llama", len(vocabulary), seed=0).save_pretrained(teacher)
    vocabulary.save_pretrained(teacher)
    args = grpo_args(tiny_llama, rl_data, str(tmp_path / "run"), distillation__enabled="true",
                     distillation__teacher_models__teacher_model__model_path=str(teacher))
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 1
    said = capsys.readouterr().err
    assert f"distillation.teacher_models.teacher_model.model_path={str(teacher)!r} has another vocabulary" in said, said


def held_out_kl(student: str, teacher: str, prompts: list[list[int]], new_tokens: int, seed: int) -> tuple[float, float]:
    """The per-token KL(student || teacher) of the student's own samples on `prompts`, by a plain transformers loop:
    sampled at temperature 1, summed over the vocabulary at each sampled position; its mean over the tokens and
    that mean's standard error."""
    from transformers import AutoModelForCausalLM

    student_model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    torch.manual_seed(seed)
    per_token = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(new_tokens):
                student_log = student_model(ids).logits[0, -1].log_softmax(-1)
                teacher_log = teacher_model(ids).logits[0, -1].log_softmax(-1)
                per_token.append(float((student_log.exp() * (student_log - teacher_log)).sum()))
                ids = torch.cat([ids, torch.multinomial(student_log.exp(), 1)[None]], dim=1)
    values = torch.tensor(per_token)
    return float(values.mean()), float(values.std() / len(values) ** 0.5)


def chat_prompts(tokenizer, path: Path) -> list[list[int]]:
    import pyarrow.parquet as pq

    texts = [tokenizer.apply_chat_template(list(row), add_generation_prompt=True, tokenize=False) for row in pq.read_table(path).column("prompt").to_pylist()]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def train_teacher(student: str, prompts: list[list[int]], answer: list[int], out: str) -> str:
    """A teacher that knows one answer: the student's copy fine-tuned by a plain torch loop to answer every prompt
    with `answer`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(40):
        batch = [prompts[(step * 8 + i) % len(prompts)] for i in range(8)]
        width = max(len(p) for p in batch) + len(answer)
        ids = torch.tensor([p + answer + [0] * (width - len(p) - len(answer)) for p in batch])
        labels = torch.tensor([[-100] * len(p) + answer + [-100] * (width - len(p) - len(answer)) for p in batch])
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(student).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss", [{"distillation.distillation_loss.loss_mode": "forward_kl_topk"},
                                  {"distillation.distillation_loss.loss_mode": "k1", "distillation.distillation_loss.use_policy_gradient": "true",
                                   "actor_rollout_ref.rollout.n": 4, "trainer.total_training_steps": 12, "trainer.save_freq": 12}],
                         ids=["forward_kl_topk", "k1_policy_gradient"])
def test_distillation_moves_the_student_towards_the_teacher(tmp_path, rl_data, loss):
    """A teacher that answers every prompt the same way, distilled into the tiny student it was fine-tuned from
    (a small vocabulary: the KL is not drowned in 49k near-uniform tokens) on 2 processes, the teacher alone
    teaching (no task rewards; the top-k forward KL as a supervised loss, and k1 as the policy gradient's reward):
    the student's per-token KL to the teacher on held-out prompts, on its own samples by a plain transformers loop,
    falls by more than 3 standard errors (a third or more with the top-k)."""
    from transformers import AutoTokenizer

    from test_grpo import grpo_args

    student = str(tmp_path / "student")
    subprocess.run([sys.executable, "scripts/make_tiny.py", student, "--tokenizer", "trained"], cwd=REPO, check=True, capture_output=True)
    tokenizer = AutoTokenizer.from_pretrained(student)
    answer = tokenizer(" seven plus one", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    teacher = train_teacher(student, chat_prompts(tokenizer, rl_data / "rl_train.parquet"), answer, str(tmp_path / "teacher"))
    out = str(tmp_path / "run")
    overrides = {"distillation__enabled": "true", "distillation__teacher_models__teacher_model__model_path": teacher,
                 "distillation__distillation_loss__use_task_rewards": "false", "trainer__total_training_steps": 8, "trainer__test_freq": -1,
                 "actor_rollout_ref__actor__optim__lr": "1e-2", "actor_rollout_ref__rollout__n": 2, "trainer__save_freq": 8,
                 "trainer__checkpoint__save_contents": "[model,hf_model]", **{k.replace(".", "__"): v for k, v in loss.items()}}
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(student, rl_data, out, **overrides))
    held_out = chat_prompts(tokenizer, rl_data / "rl_val.parquet") + chat_prompts(tokenizer, rl_data / "rl_test.parquet")
    before, before_error = held_out_kl(student, teacher, held_out, 8, seed=0)
    steps = overrides["trainer__total_training_steps"]
    after, after_error = held_out_kl(str(Path(out) / f"global_step_{steps}" / "huggingface"), teacher, held_out, 8, seed=0)
    print(before, before_error, after, after_error)
    assert before - after > 3 * (before_error**2 + after_error**2) ** 0.5, (before, before_error, after, after_error)
    if loss["distillation.distillation_loss.loss_mode"] == "forward_kl_topk":
        assert after < 2 / 3 * before, (before, after)
        logged_loss = logged(out, "actor/distillation/loss")
        assert logged_loss[-1] < 2 / 3 * logged_loss[0], logged_loss
