"""DeepSeek-V4.1 / V4 chat encoding against golden files (input JSON -> exact prompt text), parse-back, errors."""
import json
from pathlib import Path

import pytest

from dsflash.serve.encoding import BOS, EOS, THINK_END, encode_messages, split_reasoning

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "encoding"
CASES = sorted(p.stem for p in GOLDEN.glob("*.json"))


def test_golden_cases_present():
    assert len(CASES) >= 10 and all((GOLDEN / f"{c}.txt").is_file() for c in CASES)


@pytest.mark.parametrize("case", CASES)
def test_golden(case):
    spec = json.loads((GOLDEN / f"{case}.json").read_text())
    expected = (GOLDEN / f"{case}.txt").read_text()
    assert encode_messages(spec.pop("messages"), **spec) == expected


@pytest.mark.parametrize("case", CASES)
def test_golden_parse_back(case):
    """A generated reply appended to a prompt parses back into the reasoning and content that produced it."""
    spec = json.loads((GOLDEN / f"{case}.json").read_text())
    if spec["messages"][-1]["role"] == "assistant":
        return
    thinking = spec["thinking"]
    reply = ("I add them." + THINK_END if thinking else "") + "The answer is 6." + EOS
    reasoning, content = split_reasoning(reply, thinking)
    assert content == "The answer is 6." and reasoning == ("I add them." if thinking else "")
    history = spec["messages"] + [{"role": "assistant", "content": content, "reasoning_content": reasoning or None}]
    spec["messages"] = history
    again = encode_messages(**{**spec, "drop_thinking": False})
    prompt = encode_messages(**{**json.loads((GOLDEN / f"{case}.json").read_text()), "drop_thinking": False})
    assert again == prompt + reply  # the reply extends the prompt exactly as the model wrote it


def test_tokenizes_to_special_ids():
    from dsflash.convert.synth import tokenizer_source_dir
    from dsflash.serve.tokenization import DeepseekTokenizer
    tok = DeepseekTokenizer(tokenizer_source_dir())
    ids = tok.encode(encode_messages([{"role": "user", "content": "Hi"}]), add_bos=False)
    assert ids[0] == 0 and ids[1] == tok.token_id("<｜User｜>")
    assert ids[-2:] == [tok.token_id("<｜Assistant｜>"), tok.token_id("</think>")]


def test_split_reasoning_cut_short():
    assert split_reasoning("still thinking", thinking=True) == ("still thinking", "")
    assert split_reasoning("plain" + EOS + "junk", thinking=False) == ("", "plain")


@pytest.mark.parametrize("messages,err", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\].role must be one of"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([{"role": "user", "content": "x", "reasoning_content": "r"}], "only allowed on assistant"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "tool_calls is not supported"),
])
def test_invalid_messages(messages, err):
    with pytest.raises(ValueError, match=err):
        encode_messages(messages)


def test_invalid_effort_and_family():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=r"integer in \[1, 100\]"):
        encode_messages(msgs, thinking=True, reasoning_effort=101)
    with pytest.raises(ValueError, match="'high' or 'max'"):
        encode_messages(msgs, family="v4", reasoning_effort="low")
    with pytest.raises(ValueError, match="family"):
        encode_messages(msgs, family="v3")
    bare = encode_messages(msgs, add_bos=False)
    assert bare.startswith("<｜User｜>") and BOS not in bare
