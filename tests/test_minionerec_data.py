"""scripts/minionerec_to_parquet.py on CSVs in MiniOneRec's column layout, written here by hand: every row's prompt
is MiniOneRec's own wording for its task (typed out below from its data.py's SidSFTDataset, SidDataset and
EvalSidDataset, not built from the script's functions), and bad rows are named."""

import json
import subprocess
import sys

import pyarrow.parquet as pq

from conftest import REPO

INDEX = {"0": ["<a_1>", "<b_2>", "<c_3>"], "1": ["<a_1>", "<b_2>", "<c_4>"], "2": ["<a_5>", "<b_6>", "<c_7>"]}
HEADER = "user_id,history_item_id,history_item_title,item_id,item_title,history_item_sid,item_sid\n"
TRAIN = HEADER + '''0,"[0, 1]","['Gloves', 'Goggles']",2,Tape,"['<a_1><b_2><c_3>', '<a_1><b_2><c_4>']",<a_5><b_6><c_7>
1,[2],['Tape'],0,Gloves,['<a_5><b_6><c_7>'],<a_1><b_2><c_3>
'''
HELD_OUT = HEADER + '''2,"[1, 2]","['Goggles', 'Tape']",0,Gloves,"['<a_1><b_2><c_4>', '<a_5><b_6><c_7>']",<a_1><b_2><c_3>
'''
PREAMBLE = ("Below is an instruction that describes a task, paired with an input that provides further context. Write a response that "
            "appropriately completes the request. \n\n### Instruction:\nCan you predict the next possible item that the user may expect?\n\n")


def convert(tmp_path, train: str = TRAIN) -> subprocess.CompletedProcess:
    (tmp_path / "items.index.json").write_text(json.dumps(INDEX))
    for name, text in (("train", train), ("valid", HELD_OUT), ("test", HELD_OUT)):
        (tmp_path / f"{name}.csv").write_text(text)
    return subprocess.run([sys.executable, "scripts/minionerec_to_parquet.py", str(tmp_path / "out"), "--index", str(tmp_path / "items.index.json"),
                           *(arg for name in ("train", "valid", "test") for arg in (f"--{name}", str(tmp_path / f"{name}.csv")))],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_rows_hold_minionerecs_prompts_histories_and_targets(tmp_path):
    result = convert(tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert json.loads((out / "items.index.json").read_text()) == INDEX
    sft = pq.read_table(out / "sft_train.parquet").column("messages").to_pylist()
    assert sft[0] == [
        {"role": "user", "content": PREAMBLE + "### User Input: \nThe user has interacted with items <a_1><b_2><c_3>, <a_1><b_2><c_4> in "
                                               "chronological order. Can you predict the next possible item that the user may expect?\n\n### Response:\n"},
        {"role": "assistant", "content": "<a_5><b_6><c_7>"}]
    assert sft[1][1]["content"] == "<a_1><b_2><c_3>" and "items <a_5><b_6><c_7> in chronological order" in sft[1][0]["content"]
    rl = pq.read_table(out / "rl_train.parquet").to_pylist()
    assert rl[0]["prompt"] == [{"role": "user", "content": "### User Input: \nThe user has interacted with items <a_1><b_2><c_3>, <a_1><b_2><c_4> "
                                                           "in chronological order. Can you predict the next possible item that the user may "
                                                           "expect?\n\n### Response:\n"}]
    assert rl[0]["reward_model"]["ground_truth"] == "<a_5><b_6><c_7>" and len(rl) == 2
    for split in ("valid", "test"):
        [row] = pq.read_table(out / f"rl_{split}.parquet").to_pylist()
        assert row["prompt"][0]["content"] == (PREAMBLE + "### User Input: \nCan you predict the next possible item the user may expect, given the "
                                               "following chronological interaction history: <a_1><b_2><c_4>, <a_5><b_6><c_7>\n\n### Response:\n")
        assert row["reward_model"]["ground_truth"] == "<a_1><b_2><c_3>"
    assert pq.read_table(out / "sft_valid.parquet").num_rows == 1


def test_the_files_are_what_the_trainers_read(tmp_path, tiny_llama, capsys):
    """What a MiniOneRec user runs first: check reads the SFT files with the index's tokens added, and the RL files
    with beams constrained to the index's items (every row tokenized, the catalog read)."""
    from fsdptrain.check import main as check_main

    assert convert(tmp_path).returncode == 0
    out, cpu = tmp_path / "out", ["--nproc-per-node", "1", "--device", "cpu"]
    assert check_main(["sft", *cpu, f"data.train_files={out}/sft_train.parquet", f"data.val_files={out}/sft_valid.parquet",
                       "data.multiturn.enable=true", "data.max_length=256", "data.train_batch_size=2", "data.micro_batch_size_per_gpu=1",
                       f"model.partial_pretrain={tiny_llama}", f"model.added_tokens_file={out}/items.index.json"]) == 0
    assert "training samples: 2 (validation: 1)" in capsys.readouterr().out
    assert check_main(["grpo", *cpu, f"data.train_files={out}/rl_train.parquet", f"data.val_files={out}/rl_valid.parquet",
                       "data.max_prompt_length=256", "data.max_response_length=8", "data.train_batch_size=2", f"actor_rollout_ref.model.path={tiny_llama}",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.beam_search=true",
                       f"actor_rollout_ref.rollout.catalog_file={out}/items.index.json", "custom_reward_function.path=null",
                       "reward.sources=[{name: ranking, function: item_ranking}]"]) == 0
    assert "training prompts: 2 (validation: 1)" in capsys.readouterr().out


def test_a_row_naming_an_item_outside_the_index_is_named(tmp_path):
    result = convert(tmp_path, TRAIN.replace("<a_5><b_6><c_7>\n1,", "<a_9><b_9><c_9>\n1,"))
    assert result.returncode == 1 and "train.csv row 0: " in result.stderr and "not in the index: <a_9><b_9><c_9>" in result.stderr
