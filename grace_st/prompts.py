"""Chat formatting and the instruction span L_sys (method.md §1, Eqs. 1 and 3).

A prompt is ``prefix ⊕ text ⊕ suffix``: ``prefix`` is everything the chat template puts
before the user text (system turn, instruction, role header), ``suffix`` closes the user
turn and opens the assistant turn. Eq. 3 pools every position after the prefix, so
``L_sys = len(prefix)``.

The prefix and suffix are found by templating a probe string and cutting around it, so
any chat template works without per-model code. The three parts are tokenized apart:
the user text is tokenized with special tokens split into plain characters, which keeps
text such as ``<|im_end|>`` or ``<|im_start|>system`` data and never markup, and keeps
``L_sys`` where the template put it whatever the text holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_INSTRUCTIONS: dict[str, str] = {
    "default": (
        "Read and analyze the following text, reason about it, then give a comprehensive understanding of it."
    ),
    "query": (
        "Read the following search query, reason about the information it asks for, "
        "then give a comprehensive understanding of it."
    ),
    "document": (
        "Read and analyze the following document, reason about its content, "
        "then give a comprehensive understanding of it."
    ),
}

# No tokenizer's template contains this, and it has no whitespace a template could trim.
_PROBE = "GRACEPROBE7f3a9c1e"


@dataclass(frozen=True)
class PromptTemplate:
    """The token ids around the user text for one instruction."""

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]

    @property
    def instruction_span(self) -> int:
        """L_sys: the number of prompt tokens before the user text (Eq. 3)."""
        return len(self.prefix_ids)

    def build(self, text_ids: list[int]) -> list[int]:
        return [*self.prefix_ids, *text_ids, *self.suffix_ids]

    def rows(self, tokenizer, texts: Sequence[str], max_input_tokens: int) -> list[list[int]]:
        """P(x) for each text, unpadded: the template around the text, the text cut to fit ``max_input_tokens``."""
        text_budget = max_input_tokens - len(self.prefix_ids) - len(self.suffix_ids)
        if text_budget < 0:
            raise ValueError(
                f"The instruction and chat template take {len(self.prefix_ids) + len(self.suffix_ids)} "
                f"tokens, more than max_input_tokens={max_input_tokens}"
            )
        return [self.build(ids[:text_budget]) for ids in tokenize_texts(tokenizer, list(texts))]


@dataclass(frozen=True)
class InstructTemplate:
    """GIRCSE's reference format (``prompt_format: instruct``): the plain string
    ``Instruct: {instruction}\\nQuery:{text}``, or the text alone where the instruction is empty (the reference's
    convention for a corpus),
    tokenized whole with no special tokens added, so the ids are the reference's; the soft tokens follow the
    text directly. Special-token strings inside a text stay plain characters, as in the chat format."""

    instruction: str
    instruction_span: int  # L_sys: the tokens of "Instruct: {instruction}\\nQuery:" (0 without an instruction)

    def text(self, text: str) -> str:
        return f"Instruct: {self.instruction}\nQuery:{text}" if self.instruction else text

    def rows(self, tokenizer, texts: Sequence[str], max_input_tokens: int) -> list[list[int]]:
        """P(x) for each text, unpadded, cut at ``max_input_tokens`` from the end (as the reference truncates)."""
        return [ids[:max_input_tokens] for ids in tokenize_texts(tokenizer, [self.text(text) for text in texts])]


def build_instruct_template(tokenizer, instruction: str) -> InstructTemplate:
    span = len(tokenize_texts(tokenizer, [f"Instruct: {instruction}\nQuery:"])[0]) if instruction else 0
    return InstructTemplate(instruction, span)


def compose_instruction(instruction: str, prompt: str | None) -> str:
    """The system instruction for one call: the GRACE instruction of the prompt type, then a
    sentence-transformers prompt (e.g. an mteb task instruction) on a line of its own. Both stay
    inside the instruction span, so neither is pooled."""
    if not prompt:
        return instruction
    return f"{instruction}\n{prompt}" if instruction else prompt


def _candidate_conversations(instruction: str) -> list[list[dict[str, str]]]:
    with_system = [{"role": "system", "content": instruction}, {"role": "user", "content": _PROBE}]
    # For templates without a system role (they raise, or drop the system turn), the
    # instruction leads the user turn instead; it still falls inside the prefix.
    in_user_turn = [{"role": "user", "content": f"{instruction}\n\n{_PROBE}" if instruction else _PROBE}]
    return [with_system, in_user_turn] if instruction else [in_user_turn]


def split_chat_template(tokenizer, instruction: str) -> tuple[str, str]:
    """Render the chat template around a probe and return the text before and after it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template: GenerativeEncoder needs a chat (instruct) "
            "model, or a tokenizer with `chat_template` set."
        )
    errors = []
    for conversation in _candidate_conversations(instruction):
        try:
            rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # jinja raises for unsupported roles; the next layout may work
            errors.append(f"{type(error).__name__}: {error}")
            continue
        if rendered.count(_PROBE) != 1 or (instruction and instruction not in rendered):
            errors.append("the template dropped the instruction or the text")
            continue
        prefix, suffix = rendered.split(_PROBE)
        return prefix, suffix
    raise ValueError(f"Could not find where the chat template puts the user text: {'; '.join(errors)}")


def build_prompt_template(tokenizer, instruction: str) -> PromptTemplate:
    prefix, suffix = split_chat_template(tokenizer, instruction)
    # The template's own text carries its markup (BOS, role tokens), so special tokens are kept
    # as such here and none are added: the template already wrote them.
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    return PromptTemplate(tuple(prefix_ids), tuple(suffix_ids))


def _type_name(value) -> str:
    """``pandas.Series`` rather than a bare ``Series``: where the object came from says what to do."""
    kind = type(value)
    package = kind.__module__.split(".")[0]
    return f"{package}.{kind.__qualname__}" if package not in ("builtins", "numpy") else kind.__name__


def _batch_hint(value) -> str:
    """Why a collection of texts can arrive as one item: sentence-transformers 6 takes only a list,
    a tuple, a NumPy array or a datasets Column as a batch, and treats anything else (a pandas
    Series, a generator, a set) as one input."""
    if isinstance(value, (bytes, bytearray, memoryview, Mapping)) or not isinstance(value, Iterable):
        return ""
    return (
        f"a collection of {_length(value)}items passed as one text (sentence-transformers takes a list, "
        "a tuple or a NumPy array as a batch of texts, anything else as a single input); pass a list, "
        "e.g. series.tolist()"
    )


def _length(value) -> str:
    try:
        return f"{len(value)} "
    except TypeError:  # a generator
        return ""


def text_problem(text) -> str | None:
    """Why ``text`` cannot be embedded (to follow "item N"), or None when it can.

    A lone surrogate (``"\\ud800"``, what ``surrogateescape`` makes of undecodable bytes)
    is not text any tokenizer can take: named here with its position, instead of the
    tokenizer's opaque ``TypeError``. A collection where a text belongs (a pandas Series that
    sentence-transformers passed on whole) says so, instead of printing its contents.
    """
    if not isinstance(text, str):
        return f"is {_type_name(text)}, not str: " + (_batch_hint(text) or f"{text!r:.80}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"is not valid Unicode: a lone surrogate U+{ord(text[error.start]):04X} at character {error.start} "
            f"of {text!r:.80} (decode bytes with errors='replace', or fix the source)"
        )
    return None


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """User texts as plain data: special-token strings inside them become ordinary tokens."""
    if not texts:
        return []
    return tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]


def build_template(tokenizer, prompt_format: str, instruction: str) -> PromptTemplate | InstructTemplate:
    """How a text becomes a prompt under ``instruction`` in ``prompt_format``: the chat template's
    (:func:`build_prompt_template`) or GIRCSE's reference format (``"instruct"``, :func:`build_instruct_template`)."""
    build = build_instruct_template if prompt_format == "instruct" else build_prompt_template
    return build(tokenizer, instruction)
