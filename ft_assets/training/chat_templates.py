"""Chat templates for base models that ship none: named ones (chatml, llama3, gemma, mistral, phi3) or a Jinja file.

An instruct model ships its chat template (tokenizer_config.json or chat_template.jinja) and the
pipeline uses it as is. A pretrained base (``google/gemma-3-270m``, a Llama 3 base, most GGUF files
of a base) has none, and the data plane cannot render a conversation without one. ``base_model``'s
``chat_template`` setting names one here or points at a Jinja file, as axolotl's ``chat_template``
and LLaMA-Factory's ``template`` do; ``apply`` writes it into the base model's tokenizer once, so
the data plane, training, the merged model, the GGUF and the published tokenizer all carry the same
template, and the choice is recorded in ``base_model``'s stats (hence in the lineage).

Each named template is its family's instruct format for text messages (tool calls and images left
out): the tokens it writes must be single tokens of the base's vocabulary (Gemma 3's pretrained
vocabulary has ``<start_of_turn>``; a Llama 3 base has the header tokens), because a template made of
text pieces the model never saw as units would train badly. ``apply`` marks them special (content
can then never forge them, and decoding drops them) and makes the template's end-of-turn token the
tokenizer's end of sequence, which the instruct releases do (Llama 3 ``<|eot_id|>``, Qwen
``<|im_end|>``): generation, in transformers and in llama.cpp, stops where the fine-tuned model was
taught to stop. A template whose tokens the vocabulary lacks is refused, naming the ones that fit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


class ChatTemplateError(ValueError):
    pass


@dataclass(frozen=True)
class NamedTemplate:
    name: str
    jinja: str
    markers: tuple[str, ...]  # the special tokens the template writes: each must be one token of the vocabulary
    end_of_turn: str | None  # the token that ends a reply, made the tokenizer's eos (None: the eos already is)
    family: str  # whose format it is


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (  # Gemma 2/3 instruct: no system role, a system message opens the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
MISTRAL = (  # Mistral instruct: [INST] user [/INST] reply</s>, no assistant header; a system message opens the first turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
PHI3 = (  # Phi-3 instruct
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

TEMPLATES = {
    t.name: t
    for t in (
        NamedTemplate("chatml", CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>", "Qwen2.5/Qwen3, SmolLM2"),
        NamedTemplate(
            "llama3", LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>", "Llama 3.x"
        ),
        NamedTemplate("gemma", GEMMA, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", "Gemma 2/3"),
        NamedTemplate("mistral", MISTRAL, ("[INST]", "[/INST]"), None, "Mistral"),
        NamedTemplate("phi3", PHI3, ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), "<|end|>", "Phi-3/3.5"),
    )
}


@dataclass(frozen=True)
class TemplateChoice:
    """What ``base_model.chat_template`` asked for, resolved: the Jinja text and where it came from."""

    setting: str  # as given: a name or a path
    jinja: str
    named: NamedTemplate | None  # None: a Jinja file

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.jinja.encode()).hexdigest()

    def record(self) -> dict:
        """What base_model's stats (and so the lineage) keep of the choice."""
        return {"setting": self.setting, "kind": "named" if self.named else "file", "sha256": self.sha256}


def choose(setting: str) -> TemplateChoice:
    """The template ``setting`` names: one of ``TEMPLATES`` or a readable Jinja file."""
    if setting in TEMPLATES:
        return TemplateChoice(setting, TEMPLATES[setting].jinja, TEMPLATES[setting])
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ChatTemplateError(
            f"base_model.chat_template {setting!r} is neither a named template ({', '.join(TEMPLATES)}) nor a Jinja file"
        )
    try:
        jinja = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"base_model.chat_template {path}: cannot read it as text ({exc})") from exc
    check_syntax(jinja, str(path))
    return TemplateChoice(setting, jinja, None)


def check_syntax(jinja: str, where: str) -> None:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(jinja)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"base_model.chat_template {where}:{exc.lineno}: not a valid Jinja template ({exc.message})"
        ) from exc


def single_token(tokenizer, text: str) -> bool:
    """Whether ``text`` is one token of the tokenizer's vocabulary (special or not)."""
    return tokenizer.convert_tokens_to_ids(text) not in (None, tokenizer.unk_token_id)


def fitting_templates(tokenizer) -> list[str]:
    """The named templates whose tokens this tokenizer has, each as one token."""
    return [t.name for t in TEMPLATES.values() if all(single_token(tokenizer, m) for m in t.markers)]


def apply(model_dir: Path, choice: TemplateChoice, log=print) -> dict:
    """Write ``choice`` into the tokenizer (and generation config) saved in ``model_dir``; what base_model records."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    own = tokenizer.chat_template
    record = choice.record()
    named = choice.named
    if named is not None:
        missing = [m for m in named.markers if not single_token(tokenizer, m)]
        if missing:
            fits = fitting_templates(tokenizer)
            raise ChatTemplateError(
                f"base_model.chat_template {named.name!r} writes {', '.join(missing)}, which the base model's vocabulary "
                f"lacks as single tokens; use {' or '.join(repr(f) for f in fits) if fits else 'a Jinja file of its own format'}"
            )
        vocabulary = len(tokenizer)
        tokenizer.add_special_tokens(
            {"additional_special_tokens": list(named.markers)}, False
        )  # False: keep the others
        assert len(tokenizer) == vocabulary, "the markers were checked to be tokens of the vocabulary already"
        if named.end_of_turn and tokenizer.eos_token != named.end_of_turn:
            record["eos_token"] = {"was": tokenizer.eos_token, "now": named.end_of_turn}
            tokenizer.eos_token = named.end_of_turn
            add_generation_eos(model_dir, tokenizer.convert_tokens_to_ids(named.end_of_turn))
    if own:
        log(f"base_model.chat_template {choice.setting!r} replaces the template the base model ships")
        record["replaced_sha256"] = hashlib.sha256(own.encode()).hexdigest()
    tokenizer.chat_template = choice.jinja
    for stale in ("chat_template.jinja", "chat_template.json"):
        (model_dir / stale).unlink(missing_ok=True)
    tokenizer.save_pretrained(model_dir)
    return record


def add_generation_eos(model_dir: Path, token_id: int) -> None:
    """Make generate() stop at ``token_id`` too: generation_config.json's eos_token_id becomes a list holding it."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if token_id not in ids:
        config["eos_token_id"] = [*ids, token_id]
        path.write_text(json.dumps(config, indent=2) + "\n")
