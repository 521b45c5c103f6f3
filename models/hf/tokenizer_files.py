"""A checkpoint's tokenizer files, checked before transformers reads them: every entry of the
directory is a regular file or a directory inside it (transformers opens files of its own choosing,
so a FIFO anywhere there could hang it), the JSON files parse, are size-bounded and hold the types
transformers expects, and ``tokenizer_config.json`` asks for no repository code. A failure names
the file and the key; ``load`` wraps whatever transformers still raises the same way."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MAX_TOKENIZER_BYTES = 256 << 20
"""tokenizer.json and every other text file a tokenizer reads whole (the largest released
tokenizer.json files are a few tens of MiB)."""
MAX_TOKENIZER_CONFIG_BYTES = 64 << 20
SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# tokenizer_config.json keys whose type transformers relies on: key -> (types, in words)
TYPES = {
    "tokenizer_class": ((str,), "a string"),
    "model_max_length": ((int, float), "a number"),
    "added_tokens_decoder": ((dict,), "an object of id -> token"),
    "additional_special_tokens": ((list,), "a list"),
    "extra_special_tokens": ((list, dict), "a list or an object"),
    "chat_template": ((str, list), "a string or a list of {name, template}"),
    "clean_up_tokenization_spaces": ((bool,), "true or false"),
    "add_bos_token": ((bool,), "true or false"),
    "add_eos_token": ((bool,), "true or false"),
    "padding_side": ((str,), "a string"),
    "truncation_side": ((str,), "a string"),
}


def has_tokenizer(directory: Path) -> bool:
    return any((directory / f).exists() or (directory / f).is_symlink() for f in TOKENIZER_FILES)


def check(directory: Path) -> None:
    """ModelLoadError naming the file (and key) that transformers' tokenizer must not read."""
    from .errors import ModelLoadError
    from .files import check_entries, read_json_object, refuse_remote_code

    check_entries(directory, ("additional_chat_templates",), text_limit=MAX_TOKENIZER_BYTES)
    config = read_json_object(directory, "config.json")  # AutoTokenizer may read its auto_map
    if config is not None:
        refuse_remote_code(directory / "config.json", config)
    where = directory / "tokenizer_config.json"
    tc = read_json_object(directory, where.name, limit=MAX_TOKENIZER_CONFIG_BYTES)
    if tc is not None:
        refuse_remote_code(where, tc)
        _check_types(tc, where, ModelLoadError)
    where = directory / "tokenizer.json"
    tj = read_json_object(directory, where.name, limit=MAX_TOKENIZER_BYTES)
    if tj is not None:
        if not isinstance(tj.get("model"), dict) or not isinstance(
            tj["model"].get("type", ""), str
        ):
            raise ModelLoadError(
                f"{where}: has no 'model' object; not a tokenizers file (save one with "
                "Tokenizer.save or a fast tokenizer's save_pretrained)"
            )
        if not isinstance(tj.get("added_tokens", []), list):
            raise ModelLoadError(f"{where}: added_tokens must be a list")
    for name in ("special_tokens_map.json", "added_tokens.json", "chat_template.json"):
        read_json_object(directory, name, limit=MAX_TOKENIZER_CONFIG_BYTES)


def _check_types(tc: dict, where: Path, error) -> None:
    for key, (types, words) in TYPES.items():
        v = tc.get(key)
        if v is not None and (
            not isinstance(v, types) or isinstance(v, bool) and bool not in types
        ):
            raise error(f"{where}: {key} must be {words}, not {type(v).__name__}")
    for key in SPECIAL:
        v = tc.get(key)
        if v is not None and not _token(v):
            raise error(f"{where}: {key} must be a string or an object with a string 'content'")
    for k, v in (tc.get("added_tokens_decoder") or {}).items():
        if not k.isdigit() or not (isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise error(
                f"{where}: added_tokens_decoder[{k[:20]!r}] must map a token id to an object "
                "with a string 'content'"
            )
    templates = tc.get("chat_template")
    if isinstance(templates, list) and not all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in templates
    ):
        raise error(f"{where}: chat_template as a list holds objects of string name and template")


def _token(v) -> bool:
    return isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"), str)


def load(directory: Path):
    """The directory's tokenizer (checked first), or None when it has no tokenizer files."""
    if not has_tokenizer(directory):
        return None
    check(directory)
    from transformers import AutoTokenizer

    from .errors import ModelLoadError
    from .files import offline

    offline()
    try:
        return AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # tokenizers, sentencepiece and transformers raise several kinds
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        present = [f for f in TOKENIZER_FILES if (directory / f).exists()]
        raise ModelLoadError(
            f"{directory}: cannot load the tokenizer ({', '.join(present)}): "
            f"{type(e).__name__}: {first}"
        ) from None
