"""Chat records and the checkpoint's chat template, without torch (preflight checks them fast).

A record holds `messages`: a list of {"role": "system" | "user" | "assistant", "content": str}. It is rendered with
the `chat_template` of the `tokenizer_config.json` beside the tokenizer, as transformers' `apply_chat_template`
renders it (a sandboxed jinja2 environment with trim_blocks / lstrip_blocks, `raise_exception`, and the config's
special-token strings such as `bos_token`), so training sees the text the model is served with.

Which characters train: each assistant reply, found by incremental rendering. The conversation up to reply i rendered
with the generation prompt is the prompt; rendered through reply i it ends where the reply does (its end-of-turn
token included); the characters between are the reply's. Templates need no `{% generation %}` markers (DeepSeek's
have none); a template whose earlier turns render differently once later turns follow (a prompt or reply that is not
a prefix of the whole conversation) is refused, since no span of the whole text is then the reply.
"""

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from torchtitan.datasets.corpus import PEEK_RECORDS, DatasetError, iter_records, resolve_corpus_files
from torchtitan.datasets.tokenizer import resolve_tokenizer_path

ROLES = ("system", "user", "assistant")
MESSAGES_FIELD = "messages"


@dataclass(frozen=True)
class RenderedChat:
    """A conversation's text and the [start, end) character spans of its assistant replies."""

    text: str
    assistant_spans: list[tuple[int, int]]


class ChatTemplate:
    """The chat template of the tokenizer_config.json beside `tokenizer_path`, rendered as transformers does."""

    def __init__(self, tokenizer_path: Path):
        self.config_path = tokenizer_path.with_name("tokenizer_config.json")
        config = _read_config(self.config_path)
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: transformers' default is the one named "default"
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
            )
        if not isinstance(source, str) or not source.strip():
            raise DatasetError(
                f"{self.config_path} has no chat_template: training.dataset_format chat renders conversations with the "
                "checkpoint's template; use the tokenizer_config.json the checkpoint ships (or add its chat_template)"
            )
        self.source = source
        # the special tokens transformers passes to the template (bos_token, eos_token, pad_token, ...)
        tokens = {key: value.get("content") if isinstance(value, dict) else value for key, value in config.items()}
        self.special_tokens = {key: v for key, v in tokens.items() if key.endswith("_token") and isinstance(v, str)}
        self._template = _compile(source, self.config_path)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def render_chat(self, messages: list[dict], where: str) -> RenderedChat:
        """The whole conversation's text and its assistant spans; `where` (file and record) names it in errors."""
        import jinja2

        try:
            text = self.render(messages)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                prompt = self.render(messages[:i], add_generation_prompt=True)
                through_reply = self.render(messages[: i + 1])
                if not (text.startswith(prompt) and text.startswith(through_reply)) or len(through_reply) < len(prompt):
                    raise DatasetError(
                        f"{where}: the chat template of {self.config_path} renders message {i} (assistant) "
                        "differently once later messages follow, so its reply has no span in the whole conversation; "
                        "split the conversation into one record per assistant reply"
                    )
                spans.append((len(prompt), len(through_reply)))
        except jinja2.TemplateError as err:
            raise DatasetError(
                f"{where}: the chat template of {self.config_path} rejects this conversation ({err}); fix the "
                "record's roles or order"
            ) from None
        return RenderedChat(text, spans)


def conversation(record: object, where: str) -> list[dict]:
    """A record's messages, checked: a list of {"role": one of ROLES, "content": str}. `where` names the record."""
    messages = record.get(MESSAGES_FIELD) if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        fields = f" (its fields: {', '.join(sorted(record)[:8])})" if isinstance(record, dict) else ""
        raise DatasetError(
            f"{where}: no {MESSAGES_FIELD!r} list{fields}; every chat record holds {MESSAGES_FIELD!r}: "
            '[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]'
        )
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(message.get("content"), str):
            raise DatasetError(
                f'{where}: message {i} is {json.dumps(message)[:80]}, not {{"role": one of {", ".join(ROLES)}, '
                '"content": a string}; fix the record'
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_files(dataset_path: str | None, section: str = "training") -> list:
    """The record files of a chat `dataset_path` (a file, a folder of them, a saved HF dataset), in reading order."""
    if dataset_path is None:
        raise DatasetError(
            f"--training.dataset_format chat needs --{section}.dataset_path: a jsonl[.gz], parquet or arrow file of "
            "records with 'messages', a folder of them, or a saved HF dataset"
        )
    files = resolve_corpus_files("", dataset_path, section)
    text_files = [str(f) for f in files if f.name.lower().endswith((".txt", ".txt.gz"))]
    if text_files:
        raise DatasetError(
            f"--{section}.dataset_path={dataset_path!r} holds plain text ({', '.join(text_files[:3])}): chat data is "
            "records with 'messages' (jsonl, parquet, arrow); move the text files out or use dataset_format text"
        )
    return files


def check_chat_data(job_config) -> None:
    """Preflight of training.dataset_format chat: the template opens and compiles, every data file's first records
    are conversations; no blend."""
    training, validation = job_config.training, job_config.validation
    if training.dataset_blend:
        raise DatasetError(
            "--training.dataset_blend is not supported with --training.dataset_format chat: give one chat file or "
            "folder as --training.dataset_path"
        )
    ChatTemplate(resolve_tokenizer_path(job_config.model.tokenizer_path))
    sections = [("training", training.dataset_path)]
    if validation.enable and validation.dataset_path:
        sections.append(("validation", validation.dataset_path))
    for section, path in sections:
        for file in chat_files(path, section):
            for index, record in enumerate(iter_records(file)):
                if index == PEEK_RECORDS:
                    break
                conversation(record, f"{file} record {index}")


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise DatasetError(
            f"no {path.name} beside the tokenizer ({path}): training.dataset_format chat renders conversations with "
            "the checkpoint's chat_template; put the checkpoint's tokenizer_config.json beside --model.tokenizer_path"
        )
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path} is not valid JSON ({err}); fix it or use the checkpoint's file") from None
    if not isinstance(config, dict):
        raise DatasetError(f"{path} is JSON but not an object; use the checkpoint's tokenizer_config.json")
    return config


def _compile(source: str, config_path: Path):
    """The template compiled in transformers' environment (sandboxed; trim_blocks, lstrip_blocks, loop controls;
    `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII characters)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise DatasetError(
            f"{config_path}'s chat_template is not a template this trainer renders ({err.message}, line {err.lineno}); "
            "use the checkpoint's tokenizer_config.json"
        ) from None
