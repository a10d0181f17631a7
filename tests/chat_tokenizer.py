"""A tiny tokenizer with a Qwen-style chat template, trained here (no downloads).

Byte-level BPE declared a ``Qwen2Tokenizer`` as Qwen's (digits split one by one), with ``<|endoftext|>`` as EOS and padding (Qwen2.5's base-model
setting), ``<|im_start|>`` / ``<|im_end|>`` as special tokens, and a chat template that writes
Qwen's turns (a default system turn when the conversation has none, ``<|im_end|>`` closing
every turn) and, like Qwen3's, an empty think block before the answer: in the generation prompt
when the template variable ``enable_thinking`` is false, and before a final assistant turn.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{%- if message['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
CORPUS = [
    "What is 12 plus 7? The answer is \\boxed{19}.",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "system user assistant You are a helpful assistant. <think> </think>",
    "0 1 2 3 4 5 6 7 8 9 10 24 72 100 plus minus times. So the total is 48 + 24 = 72.",
]


def save_chat_tokenizer(directory: Path, *, vocab_size: int = 400) -> Path:
    """Train and save the tokenizer (tokenizer.json, tokenizer_config.json, chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS,
                                      additional_special_tokens=[IM_START, IM_END])
    wrapped.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(directory)
    # Declared a Qwen2 tokenizer, as Qwen's are: transformers then loads it the same way from a
    # tokenizer directory and from a model directory (beside a qwen2 config.json it would
    # otherwise switch to Qwen2Tokenizer, whose pre-tokenizer splits digits, and encode the
    # same text differently).
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return directory
