"""Chat data (datasets/chat.py, chat_format.py): the loss mask against transformers' own chat templating, packing,
the one-line errors, resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit.datasets.conftest import SHIPPED_TOKENIZER
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.datasets.chat import IGNORE_INDEX as CHAT_IGNORE_INDEX
from torchtitan.datasets.chat import _trained_tokens
from torchtitan.datasets.chat_format import ChatTemplate, check_chat_data
from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.dataloader import build_dataloader
from torchtitan.datasets.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # the shipped tokenizer's special tokens stand in for the models'

SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello. How can I help?"}],
    [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?\n"},
        {"role": "assistant", "content": " 4, of course."},
        {"role": "user", "content": "And 3 times 3?"},
        {"role": "assistant", "content": "9\n\nNine."},
    ],
    [SYSTEM, {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}],
]


def tokenizer_folder(tmp_path: Path, template: str) -> Path:
    """The shipped tokenizer.json with a tokenizer_config.json holding `template` (a file of TEMPLATES)."""
    folder = tmp_path / f"tokenizer_{template}"
    folder.mkdir()
    shutil.copy(SHIPPED_TOKENIZER, folder / "tokenizer.json")
    config = {"chat_template": (TEMPLATES / template).read_text(), "bos_token": BOS, "eos_token": EOS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def reference_mask(tokenizer_path: Path, messages: list[dict]) -> tuple[list[int], list[bool]] | None:
    """transformers' apply_chat_template, tokens and the incremental rule: the tokens that rendering through reply i
    adds to the conversation up to it with the generation prompt are trained. None where a prefix is not one."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), bos_token=BOS, eos_token=EOS)
    hf.chat_template = json.loads(tokenizer_path.with_name("tokenizer_config.json").read_text())["chat_template"]

    def ids(chat: list[dict], prompt: bool = False) -> list[int]:
        return list(hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)["input_ids"])

    full = ids(messages)
    trained = [False] * len(full)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt, through = ids(messages[:i], prompt=True), ids(messages[: i + 1])
            if through[: len(prompt)] != prompt or full[: len(through)] != through:
                return None
            trained[len(prompt) : len(through)] = [True] * (len(through) - len(prompt))
    return full, trained


def our_mask(tokenizer_path: Path, messages: list[dict]) -> tuple[list[int], list[bool]]:
    chat = ChatTemplate(tokenizer_path).render_chat(messages, "test")
    ids, offsets = Tokenizer(tokenizer_path).encode_batch_with_offsets([chat.text])[0]
    return ids, _trained_tokens(offsets, chat.assistant_spans).tolist()


@pytest.mark.parametrize(
    "template", ["deepseek_v3_0324.jinja", "moonlight_16b_a3b_instruct.jinja", "deepseek_v2_chat.jinja", "qwen3.jinja"]
)
def test_mask_matches_transformers(tmp_path, template):
    path = tokenizer_folder(tmp_path, template)
    for messages in CONVERSATIONS:
        reference = reference_mask(path, messages)
        if reference is None:  # Qwen3 drops earlier replies' think blocks: no incremental span, refused
            assert template == "qwen3.jinja"
            with pytest.raises(DatasetError, match="one record per assistant reply"):
                our_mask(path, messages)
            continue
        assert our_mask(path, messages) == reference
        assert sum(reference[1]) > 0


def test_ignore_index_is_the_losses():
    assert CHAT_IGNORE_INDEX == IGNORE_INDEX


def write_chats(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text(
        "".join(json.dumps({"messages": messages, "id": i}) + "\n" for i, messages in enumerate(conversations))
    )
    return path


def chat_job(make_job_config, data: Path, tokenizer_path: Path, seq_len: int = 64, batch: int = 2):
    job_config = make_job_config(data, seq_len=seq_len, local_batch_size=batch)
    job_config.training.dataset_format = "chat"
    job_config.model.tokenizer_path = str(tokenizer_path)
    return job_config


def test_packed_conversations_train_as_alone(tmp_path, make_job_config):
    """Each conversation's tokens, labels and one document id in the packed batch equal the conversation alone."""
    path = tokenizer_folder(tmp_path, "deepseek_v3_0324.jinja")
    conversations = [CONVERSATIONS[0], CONVERSATIONS[2]] * 3
    job_config = chat_job(make_job_config, write_chats(tmp_path / "chats.jsonl", conversations), path, 127, 4)
    loader = build_dataloader(job_config, Tokenizer(path), 4096, 0, 1)
    inputs, labels = next(iter(loader))
    tokens = torch.cat([inputs["input"], labels[:, -1:]], dim=1)  # labels' last token is the window's last
    alone = [our_mask(path, messages) for messages in conversations]
    found = 0
    for row in range(tokens.shape[0]):
        if found == len(alone):  # the next epoch
            break
        document_ids = inputs["document_ids"][row]
        for document in document_ids.unique().tolist():
            where = (document_ids == document).nonzero().flatten()
            start, end = int(where[0]), int(where[-1]) + 1
            if tokens[row, start] == Tokenizer(path).eos_id:  # the padding
                assert (labels[row, max(start - 1, 0) : end - 1] == IGNORE_INDEX).all()
                continue
            ids, trained = alone[found]
            assert tokens[row, start:end].tolist() == ids
            # the label of position k is token k + 1: trained exactly where the token is
            expected = [token if keep else IGNORE_INDEX for token, keep in zip(ids[1:], trained[1:], strict=True)]
            assert labels[row, start : end - 1].tolist() == expected
            found += 1
    assert found == len(alone)


def test_resume_mid_epoch_is_exact(tmp_path, make_job_config):
    path = tokenizer_folder(tmp_path, "moonlight_16b_a3b_instruct.jinja")
    data = write_chats(tmp_path / "chats.jsonl", CONVERSATIONS * 4)
    job_config = chat_job(make_job_config, data, path, seq_len=200, batch=1)
    tokenizer = Tokenizer(path)
    first = build_dataloader(job_config, tokenizer, 4096, 1, 2)
    batches = iter(first)
    next(batches), next(batches)
    state = first.state_dict()
    expected = [next(batches) for _ in range(3)]
    second = build_dataloader(job_config, tokenizer, 4096, 1, 2)
    second.load_state_dict(state)
    for (inputs, labels), (want_inputs, want_labels) in zip(second, expected, strict=False):
        assert torch.equal(inputs["input"], want_inputs["input"]) and torch.equal(labels, want_labels)
        assert torch.equal(inputs["document_ids"], want_inputs["document_ids"])
    # rank 1 of 2 reads the other batches than rank 0, and the dataset counts the trained labels it yields
    rank0 = next(iter(build_dataloader(job_config, tokenizer, 4096, 0, 2)))
    assert len(first.dataset.mixture) > 2 and not torch.equal(rank0[0]["input"], expected[0][0]["input"])
    samples = [first.dataset.mixture.sample(i) for i in range(5)]
    assert first.dataset.trained_tokens(5) == sum(int(trained.sum()) for _, _, trained in samples)


def test_errors_are_one_line(tmp_path, make_job_config):
    path = tokenizer_folder(tmp_path, "deepseek_v3_0324.jinja")
    tokenizer = Tokenizer(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps({"text": "no chat"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl record 1: no 'messages' list \(its fields: text\)"):
        build_dataloader(chat_job(make_job_config, bad, path), tokenizer, 4096, 0, 1)

    role = write_chats(tmp_path / "role.jsonl", [[{"role": "robot", "content": "beep"}]])
    with pytest.raises(DatasetError, match="role.jsonl record 0: message 0 is .*robot.* not"):
        check_chat_data(chat_job(make_job_config, role, path))

    long = write_chats(tmp_path / "long.jsonl", [[{"role": "user", "content": "x " * 200}, CONVERSATIONS[0][1]]])
    with pytest.raises(DatasetError, match=r"long.jsonl record 0: .* longer than a sequence .*--training.chat_trunc"):
        build_dataloader(chat_job(make_job_config, long, path), tokenizer, 4096, 0, 1)
    truncating = chat_job(make_job_config, long, path)
    truncating.training.chat_truncate = True
    with pytest.raises(DatasetError, match="no conversation with an assistant reply"):  # the reply was cut away
        build_dataloader(truncating, tokenizer, 4096, 0, 1)

    raising = tokenizer_folder(tmp_path, "moonlight_16b_a3b_instruct.jinja")
    config_path = raising.with_name("tokenizer_config.json")
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    system_first = write_chats(tmp_path / "system.jsonl", [CONVERSATIONS[2]])
    with pytest.raises(DatasetError, match="system.jsonl record 0: the chat template .* rejects .*no system role"):
        build_dataloader(chat_job(make_job_config, system_first, raising), Tokenizer(raising), 4096, 0, 1)

    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(DatasetError, match=r"tokenizer_config.json has no chat_template: .*tokenizer_config.json"):
        check_chat_data(chat_job(make_job_config, system_first, raising))


def test_parquet_and_truncation(tmp_path, make_job_config):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tokenizer_folder(tmp_path, "deepseek_v3_0324.jinja")
    long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a long reply " * 30}]
    data = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"messages": [CONVERSATIONS[0], long]}), data)
    job_config = chat_job(make_job_config, data, path, seq_len=32, batch=2)
    job_config.training.chat_truncate = True
    inputs, labels = next(iter(build_dataloader(job_config, Tokenizer(path), 4096, 0, 1)))
    assert inputs["input"].shape == labels.shape == (2, 32) and inputs["document_ids"].shape == (2, 33)
    # the long conversation cut to the whole window, its reply's start trained to the window's end
    assert (inputs["document_ids"][1] == 1).all() and (labels[1, -8:] != IGNORE_INDEX).all()
