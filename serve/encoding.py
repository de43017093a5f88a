"""DeepSeek-V4.1 / V4 chat encoding: OpenAI-style messages -> prompt text, and a completion -> reasoning + content.

The format is the one the DeepSeek release ships as `encoding/encoding_dsv4.py` (V4) and its V4.1 successor:

    <BOS>[<｜System｜>][effort][system]<｜User｜>question<｜Assistant｜></think>answer<EOS><｜User｜>...<｜Assistant｜>X

- X, the generation header after the last user turn, is `</think>` in chat mode and `<think>` in thinking mode.
- V4.1 writes a `<｜System｜>` token before the system text (and before the effort line in thinking mode, even with no
  system message); a later system message is a turn of its own (`<｜System｜>text`) and, like a user turn, is
  followed by the assistant header. V4 has no system token: the system text opens the prompt as is.
- Thinking mode puts a reasoning-effort line first: V4.1 `Reasoning Effort: N (range 1-100, ...)` (default "high"
  = 50); V4 only for effort "max".
- Past assistant turns are `reasoning</think>content<EOS>` in thinking mode, `content<EOS>` in chat mode; with
  drop_thinking (the default) the reasoning of turns before the last user turn is dropped, together with their
  `</think>`, and their user turns end in `<｜Assistant｜></think>`.

Covered here: system, user and assistant turns (text, or lists of text parts), thinking on/off, reasoning effort.
Tools, tool results, images and the internal task tokens are refused with a ValueError naming what is unsupported.
"""
from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"  # V4.1 only
THINK_START, THINK_END = "<think>", "</think>"

V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
V41_EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
V4_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
ROLES = ("system", "user", "assistant")


@dataclass
class Turn:
    role: str
    content: str
    reasoning: str = ""


def _text(content, where: str) -> str:
    """A message's content: a string, None, or a list of {"type": "text", "text": ...} parts (blank-line joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "\n\n".join(parts)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def parse_messages(messages) -> list[Turn]:
    """Validate OpenAI-style messages into turns; ValueError names the first offending message and field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        for key in ("tool_calls", "tools", "tool_call_id", "task"):
            if m.get(key):
                raise ValueError(f"{where}.{key} is not supported by this server")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning_content must be a string")
        if reasoning and role != "assistant":
            raise ValueError(f"{where}.reasoning_content is only allowed on assistant messages")
        turns.append(Turn(role, _text(m.get("content"), where), reasoning))
    return turns


def _effort_line(family: str, thinking: bool, effort) -> str:
    if family == "v41":
        effort = "high" if effort is None else effort
        if not ((type(effort) is int and 1 <= effort <= 100) or effort in V41_EFFORTS):
            raise ValueError(f"reasoning_effort must be an integer in [1, 100] or one of {list(V41_EFFORTS)}, "
                             f"got {effort!r}")
        return V41_EFFORT_LINE.format(V41_EFFORTS.get(effort, effort)) if thinking else ""
    if effort not in (None, "high", "max"):
        raise ValueError(f"reasoning_effort for DeepSeek-V4 must be 'high' or 'max', got {effort!r}")
    return V4_EFFORT_MAX if thinking and effort == "max" else ""


def _opens_generation(family: str, turns: list[Turn], i: int) -> bool:
    """User turns (and, in V4.1, system turns after the first message) are followed by the assistant header."""
    return turns[i].role == "user" or (family == "v41" and turns[i].role == "system" and i > 0)


def encode_messages(messages, family: str = "v41", thinking: bool = False, reasoning_effort=None,
                    drop_thinking: bool = True, add_bos: bool = True) -> str:
    """The prompt text for `messages` (ends with the assistant header when the last turn is a user turn)."""
    if family not in ("v41", "v4"):
        raise ValueError(f"family must be 'v41' or 'v4', got {family!r}")
    turns = parse_messages(messages)
    last_user = max((i for i in range(len(turns)) if _opens_generation(family, turns, i)), default=-1)
    effort = _effort_line(family, thinking, reasoning_effort)
    out = [BOS] if add_bos else []
    for i, t in enumerate(turns):
        if i == 0 and family == "v41" and (effort or t.role == "system"):
            out.append(SYSTEM)
        if i == 0:
            out.append(effort)
        if t.role == "system":
            out.append((SYSTEM if family == "v41" and i > 0 else "") + t.content)
        elif t.role == "user":
            out.append(USER + t.content)
        else:
            keep = thinking and (not drop_thinking or i > last_user)
            out.append((t.reasoning + THINK_END if keep else "") + t.content + EOS)
        nxt = turns[i + 1].role if i + 1 < len(turns) else None
        if nxt in (None, "assistant") and _opens_generation(family, turns, i):
            think = thinking and (not drop_thinking or i >= last_user)
            out.append(ASSISTANT + (THINK_START if think else THINK_END))
    return "".join(out)


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a completion decoded with special tokens kept; EOS and anything after it dropped.

    In thinking mode the reasoning runs up to the first `</think>`; a completion cut before it is all reasoning.
    """
    text = text.split(EOS, 1)[0]
    if not thinking:
        return "", text
    reasoning, sep, content = text.partition(THINK_END)
    return (reasoning, content) if sep else (text, "")
