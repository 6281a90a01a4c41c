"""Chat templates render exactly as Hugging Face's apply_chat_template does."""

from __future__ import annotations

import pytest

from bargein.loader import ChatTemplateError, Tokenizer, load_tokenizer, resolve_model_ref
from bargein.loader.chat_template import render_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you? 😀\n\nTwo lines."},
        {"role": "assistant", "content": "Très bien."},
        {"role": "user", "content": '<b>html</b> & "quotes"'},
    ],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_ref(None))


@pytest.fixture(scope="module")
def reference(tokenizer: Tokenizer):
    """transformers' renderer, over our backend (building HF's GGUF tokenizer takes 10 s)."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_bundled_template_equals_reference(
    tokenizer, reference, messages, add_generation_prompt
) -> None:
    expected = reference.apply_chat_template(
        messages,
        chat_template=tokenizer.chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert (
        tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        == expected
    )


FEATURES = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}"
    "{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}"
    "{% generation %}[{{ m.role }}]{{ m.content }}{% endgeneration %}\n"
    "{% endfor %}{% if tools %}TOOLS {{ tools | tojson }}{% endif %}"
    "{{ extra_var | default('') }}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
)


@pytest.mark.slow
@pytest.mark.parametrize("with_tools", [False, True])
def test_template_features_equal_reference(tokenizer, reference, with_tools: bool) -> None:
    messages = [{"role": "user", "content": '<é> & "x"'}, {"role": "assistant", "content": "ok"}]
    tools = (
        [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>"}}]
        if with_tools
        else None
    )
    expected = reference.apply_chat_template(
        messages,
        chat_template=FEATURES,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        extra_var="X",
    )
    got = render_chat_template(
        FEATURES,
        messages,
        tools=tools,
        extra_var="X",
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    assert got == expected


def test_template_error_carries_its_message() -> None:
    with pytest.raises(ChatTemplateError, match="role bad is not allowed"):
        render_chat_template(FEATURES, [{"role": "bad", "content": ""}])


def test_template_syntax_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% for m in messages %}", [])


def test_no_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "hi"}])


def test_sandbox_blocks_attribute_escape() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_strftime_now() -> None:
    import datetime

    assert render_chat_template("{{ strftime_now('%Y') }}", []) == str(datetime.datetime.now().year)
