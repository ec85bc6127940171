"""The trainer on chat data: conversations rendered with DeepSeek-V3's template, packed with block-causal attention,
only the replies trained; metrics.jsonl carries each step's trained-token count."""

import json
import shutil

from tests.integration.conftest import FAST_ARGS, REPO_ROOT, read_losses, run_trainer

TEMPLATE = REPO_ROOT / "tests/unit/datasets/chat_templates/deepseek_v3_0324.jinja"


def test_chat_fine_tuning_trains_the_replies(tmp_path, dump_folder):
    tokenizer = tmp_path / "tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir()
    shutil.copy(REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json", tokenizer)
    config = {"chat_template": TEMPLATE.read_text(), "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    tokenizer.with_name("tokenizer_config.json").write_text(json.dumps(config))
    chats = tmp_path / "chats.jsonl"
    records = [
        {"messages": [{"role": "user", "content": f"Add {i} and {i}."}, {"role": "assistant", "content": f"{2 * i}"}]}
        for i in range(40)
    ]
    chats.write_text("".join(json.dumps(record) + "\n" for record in records))
    args = [
        *FAST_ARGS,
        "--training.dataset_format", "chat",
        "--training.dataset_path", str(chats),
        "--model.tokenizer_path", str(tokenizer),
        "--model.attn_mask_type", "block_causal",
        "--training.seq_len", "64",
        "--training.steps", "2",
        "--checkpoint.enable=false",
    ]  # fmt: skip
    run_trainer(dump_folder, args)
    losses = read_losses(dump_folder)
    trained = read_losses(dump_folder, "trained_tokens")
    assert sorted(losses) == [1, 2] and all(0 < loss < 20 for loss in losses.values())
    # 4 sequences of 64 labels a step; the replies (a number and the end-of-sentence string) are a small part
    assert all(0 < count < 4 * 64 / 2 for count in trained.values())
