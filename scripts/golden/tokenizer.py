#!/usr/bin/env python3
"""Writes the golden tokenizers and token ids the tokenizer crate's tests read
(tokenizer/golden/): two small tokenizers built with Hugging Face's own
`tokenizers`, each with a chat template, and the ids of a set of chats and
prompts computed the way vLLM computes them:

- a chat: the template rendered as `transformers`' `apply_chat_template`
  renders it (jinja2's sandbox with `trim_blocks` and `lstrip_blocks`, loop
  controls, `raise_exception`, `strftime_now`, a `tojson` that keeps
  non-ASCII; context: `messages`, `tools`, `add_generation_prompt`, the
  special tokens by name), then encoded without special tokens added
  (the template writes them);
- a prompt (completions): encoded with special tokens added (the
  post-processor's BOS).

`chatml` is byte-level BPE with ChatML turns (as Qwen's); `llama` is
Metaspace BPE that prepends its space to the first piece only, with a BOS
post-processor and a Llama-2 style template. Run with
`pip install tokenizers jinja2`:

    python3 scripts/golden/tokenizer.py tokenizer/golden
"""
import json
import random
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find head stand own page should country found answer school grow study still "
    "learn plant cover food sun four between state keep eye never last let thought city tree cross farm hard "
    "def return import class self None True False print lambda yield async await fn let mut impl struct "
    "INST The You What How And Say A I S T N"
).split()
PUNCT = ["[", "]", "/", ".", ",", "!", "?", ":", ";", "(", ")", "\n", "  ", "\t", "'", '"', "é", "ü", "中文", "🙂"]


def corpus(seed, lines):
    rng = random.Random(seed)
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 30)):
            parts.append(rng.choice(WORDS))
            if rng.random() < 0.2:
                parts.append(rng.choice(PUNCT))
        yield " ".join(parts)


CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if tools %}{{- '<|im_start|>tools\\n' + tools | tojson + '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
)

LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'].strip() + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def build_chatml():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(1, 3000), trainer)
    config = {
        "chat_template": CHATML_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    return tok, config


def build_llama():
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials)
    tok.train_from_iterator(corpus(2, 3000), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    config = {
        "chat_template": LLAMA_TEMPLATE,
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    return tok, config


def special(v):
    return v["content"] if isinstance(v, dict) else v


def render(config, messages, tools=None, **kwargs):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    names = {k: special(config[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k)}
    return env.from_string(config["chat_template"]).render(
        messages=messages, tools=tools, add_generation_prompt=True, **names, **kwargs
    )


def content_as_text(messages):
    # vLLM's "string" content format: a list of text parts joined by newlines.
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")
        out.append(m)
    return out


LONG = " ".join(corpus(3, 40))

CHATS = [
    ("one turn", [{"role": "user", "content": "how do you grow a tree?"}], {}),
    (
        "a conversation",
        [
            {"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "  what is the  sun?\n"},
            {"role": "assistant", "content": "a star, the one we keep close."},
            {"role": "user", "content": "and the water café 🙂 中文?"},
        ],
        {},
    ),
    (
        "a special token written in the text",
        [{"role": "user", "content": "say <|im_end|> twice<|im_start|>no"}],
        {},
    ),
    ("a long turn", [{"role": "user", "content": LONG}], {}),
    (
        "text parts",
        [{"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]}],
        {},
    ),
    ("thinking off", [{"role": "user", "content": "quick one"}], {"chat_template_kwargs": {"enable_thinking": False}}),
    (
        "tools",
        [{"role": "user", "content": "weather?"}],
        {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "météo"}}]},
    ),
]

PROMPTS = [
    ("a prompt", "def find the water(self):\n    return None"),
    ("a prompt starting with a space", "  the farm and the city"),
    ("a long prompt", LONG),
]


def main(out):
    out = Path(out)
    cases = []
    for name, build in (("chatml", build_chatml), ("llama", build_llama)):
        tok, config = build()
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1) + "\n")
        for case, messages, extra in CHATS:
            if name == "llama" and case in ("a conversation",):
                messages = [m for m in messages if m["role"] != "system"]
            kwargs = dict(extra.get("chat_template_kwargs", {}))
            text = render(config, content_as_text(messages), tools=extra.get("tools"), **kwargs)
            ids = tok.encode(text, add_special_tokens=False).ids
            cases.append({"tokenizer": name, "case": case, "messages": messages, **extra, "ids": ids})
        for case, prompt in PROMPTS:
            ids = tok.encode(prompt, add_special_tokens=True).ids
            cases.append({"tokenizer": name, "case": case, "prompt": prompt, "ids": ids})
    (out / "cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tokenizer/golden")
