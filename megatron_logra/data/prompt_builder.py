"""How a problem becomes token ids: the one place that builds prompts, supervised targets and
the set of stop tokens, for the built-in sampler, a separate engine (vLLM or Megatron) and the
trainer alike.

**Prompt.** The user text is the row's prompt, put into ``data.prompt.user_template`` where it
says ``{prompt}``. With ``data.prompt.chat_template`` the tokenizer's own chat template renders
``[system?, context..., user]`` with its generation prompt (``template_kwargs`` passed through,
e.g. ``enable_thinking``) and the rendered text is encoded with its special tokens as text (what
``apply_chat_template(tokenize=True)`` returns); without it the user text is encoded as it is.

**Supervised target.** The prompt's ids exactly as rollouts see them, then the target's ids and
one stop token: the template's end of turn (``<|im_end|>`` for Qwen), or EOS for plain text.
With a template, the target is the assistant turn the template renders after the generation
prompt (anything it puts before the content, such as an empty think block, included), cut at
the end-of-turn token (the newline a template writes after it is never generated). No separator
is invented between prompt and target: plain-text data says its own spacing.

**Stop tokens** are a set: EOS, the ``eos_token_id`` list of the tokenizer directory's
generation_config.json (``tools/convert_hf.py`` copies the model's), and with a template its end
of turn. A response ends with (and keeps) the first one it samples.
"""

from __future__ import annotations

from typing import Any

from megatron_logra.config import PromptConfig
from megatron_logra.config.data import PROMPT_PLACEHOLDER
from megatron_logra.data.prompt_data import PromptProblem

# Content of a probe assistant turn, to find what a template writes after an answer: text no
# template adds itself.
_PROBE_CONTENT = "\u2063megatron-logra probe answer\u2063"


class PromptBuilder:
    """Prompt ids, supervised samples and stop tokens of one tokenizer and ``data.prompt``."""

    def __init__(self, tokenizer: Any, prompt: PromptConfig) -> None:
        self.tokenizer = tokenizer
        self.config = prompt
        self.end_of_turn: int | None = None
        if prompt.chat_template:
            if not getattr(tokenizer, "has_chat_template", False):
                raise ValueError(
                    f"data.prompt.chat_template=true but the tokenizer "
                    f"({getattr(tokenizer, 'path', tokenizer)}) has no chat template; use the "
                    "model's own tokenizer directory (with its chat_template) or set "
                    "data.prompt.chat_template=false"
                )
            self.end_of_turn = self._template_end_of_turn()
        stops = [tokenizer.eos_id, *getattr(tokenizer, "generation_stop_ids", ())]
        if self.end_of_turn is not None:
            stops.append(self.end_of_turn)
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        bad = [t for t in self.stop_ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} (EOS, generation_config.json's "
                             f"eos_token_id) are outside the tokenizer's {tokenizer.vocab_size} "
                             "ids; fix the tokenizer directory's generation_config.json")
        self.target_end: int = tokenizer.eos_id if self.end_of_turn is None else self.end_of_turn
        """The stop token a supervised target ends with."""
        self._cache: dict[tuple, list[int]] = {}

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    # ------------------------------------------------------------------ prompts

    def _render(self, turns: list[tuple[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(turns, add_generation_prompt=generation_prompt,
                                          template_kwargs=self.config.template_kwargs)

    def turns(self, problem: PromptProblem) -> list[tuple[str, str]]:
        """The conversation up to the user turn: system prompt, context, templated user text."""
        template = self.config.user_template
        user = template.replace(PROMPT_PLACEHOLDER, problem.prompt) if template else problem.prompt
        context = list(problem.context)
        system = self.config.system_prompt
        if system is not None:
            if context and context[0][0] == "system":
                raise ValueError(f"{problem.origin}: the row has its own system turn and "
                                 "data.prompt.system_prompt is set too; drop one of them")
            context.insert(0, ("system", system))
        return [*context, ("user", user)]

    def prompt_text(self, problem: PromptProblem) -> str:
        """The text the prompt ids encode."""
        turns = self.turns(problem)
        if self.config.chat_template:
            return self._render(turns, generation_prompt=True)
        if len(turns) > 1:
            raise ValueError(f"{problem.origin}: a messages prompt with {len(turns) - 1} turn(s) "
                             "before the user's needs data.prompt.chat_template=true (plain text "
                             "has no turns)")
        return turns[0][1]

    def prompt_ids(self, problem: PromptProblem) -> list[int]:
        key = (problem.prompt, problem.context)
        if key not in self._cache:
            ids = self.tokenizer.encode(self.prompt_text(problem))
            if not ids:
                raise ValueError(f"{problem.origin}: the prompt {problem.prompt!r} encodes to no "
                                 "tokens")
            self._cache[key] = ids
        return self._cache[key]

    # ------------------------------------------------------------------ supervised targets

    def supervised_tokens(self, problem: PromptProblem) -> tuple[list[int], int]:
        """``(prompt ids + target ids + [stop], number of prompt ids)``."""
        prompt_ids = self.prompt_ids(problem)
        target = problem.target
        head = ""
        if self.config.chat_template:
            turns = self.turns(problem)
            generation = self._render(turns, generation_prompt=True)
            whole = self._render([*turns, ("assistant", target)], generation_prompt=False)
            at = whole.find(target, len(generation))
            if not whole.startswith(generation) or at < 0:
                raise ValueError(
                    f"{problem.origin}: the chat template does not render the answer as a "
                    "continuation of its generation prompt (with template_kwargs "
                    f"{self.config.template_kwargs}); a supervised target would not continue "
                    "what rollouts see"
                )
            head = whole[len(generation):at]
        completion = (self.tokenizer.encode(head) if head else []) + self.tokenizer.encode(target)
        return [*prompt_ids, *completion, self.target_end], len(prompt_ids)

    def _template_end_of_turn(self) -> int | None:
        """The special token the template closes an assistant turn with (None: none)."""
        turns = [("user", "1 + 1?")]
        generation = self._render(turns, generation_prompt=True)
        whole = self._render([*turns, ("assistant", _PROBE_CONTENT)], generation_prompt=False)
        if not whole.startswith(generation) or _PROBE_CONTENT not in whole:
            return None
        after = self.tokenizer.encode(whole.split(_PROBE_CONTENT, 1)[1])
        return after[0] if after and self.tokenizer.is_special(after[0]) else None

    # ------------------------------------------------------------------ responses

    def finished(self, response: list[int]) -> bool:
        return bool(response) and response[-1] in self.stop_ids

    def response_text(self, response: list[int]) -> str:
        """A response's text for the reward: without its stop token."""
        if self.finished(response):
            response = response[:-1]
        return self.tokenizer.decode(response)
