"""The lazily importing registry: names declared once, listed without importing, factories
imported on first lookup; and the four registries built on it (attention backends, models,
tool-call parsers, grammar backends) keep their lookups and error messages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from braid.runtime.registry import Registry


def test_names_are_listed_sorted_and_unknown_names_raise_listing_them():
    reg = Registry("thing", {"b": "tests.runtime.test_registry", "a": "tests.runtime.test_x"})
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg
    with pytest.raises(ValueError, match=r"thing 'c' is unknown \(have \['a', 'b'\]\)"):
        reg.get("c")
    custom = Registry("thing", {"a": "m"}, unknown="no {kind} called {name!r}; try {known}")
    with pytest.raises(ValueError, match=r"no thing called 'z'; try \['a'\]"):
        custom.get("z")


def test_register_returns_the_factory_and_every_name_of_its_module_means_it():
    reg = Registry("thing", {"one": __name__, "two": __name__, "other": "elsewhere"})

    class Factory:
        pass

    assert reg.register(Factory) is Factory
    assert reg.get("one") is Factory and reg.get("two") is Factory


def test_register_refuses_an_undeclared_module_and_a_second_factory():
    reg = Registry("thing", {"one": __name__})
    undeclared = Registry("thing", {"one": "somewhere.else"})

    class First:
        pass

    class Second:
        pass

    with pytest.raises(ValueError, match="not in the thing table"):
        undeclared.register(First)
    reg.register(First)
    with pytest.raises(ValueError, match="two thing factories"):
        reg.register(Second)


def test_a_declared_module_that_registers_nothing_is_a_clear_error():
    reg = Registry("thing", {"json": "json"})
    with pytest.raises(RuntimeError, match="registered nothing"):
        reg.get("json")


def test_listing_names_imports_no_factory_module():
    """In a fresh interpreter: listing every registry's names imports none of their modules;
    looking one up imports just that one."""
    code = textwrap.dedent(
        """
        import sys
        from braid.runtime.attention import backend_names
        from braid.runtime.constrained import grammar_backend_names
        from braid.runtime.function_call import PARSER_NAMES
        from braid.runtime.models import supported_architectures
        from braid.runtime.scheduler.policies import policy_names

        assert backend_names() == ["flashinfer", "torch_native", "triton"]
        assert grammar_backend_names() == ["llguidance", "outlines", "xgrammar"]
        assert PARSER_NAMES == ("hermes", "llama3", "mistral", "pythonic")
        assert policy_names() == ["fcfs", "lpm", "priority", "program", "program-srpt"]
        assert supported_architectures() == [
            "LlamaForCausalLM", "LlamaModel", "LlavaForConditionalGeneration",
            "LlavaNextForConditionalGeneration", "MistralForCausalLM", "MistralModel",
            "Qwen2ForCausalLM", "Qwen2Model", "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3Model",
            "Qwen3VLForConditionalGeneration",
        ]
        lazy = [
            "braid.runtime.attention.torch_native", "braid.runtime.attention.triton_backend",
            "braid.runtime.attention.flashinfer_backend", "flashinfer",
            "braid.runtime.constrained.grammar", "braid.runtime.constrained.outlines_backend",
            "braid.runtime.constrained.xgrammar_backend", "xgrammar", "llguidance",
            "braid.runtime.function_call.hermes",
            "braid.runtime.models.llama", "braid.runtime.models.qwen2_vl",
            "braid.runtime.models.llava", "braid.runtime.models.qwen3_vl", "triton",
            "braid.runtime.scheduler.policy", "braid.runtime.scheduler.policies.lpm",
            "braid.runtime.scheduler.policies.program_srpt",
            "braid.runtime.scheduler.policies.priority",
        ]
        assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]
        from braid.runtime.function_call import get_parser
        assert get_parser("hermes").__name__ == "HermesParser"
        assert "braid.runtime.function_call.hermes" in sys.modules
        assert "braid.runtime.function_call.mistral" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_registries_resolve_their_names_and_keep_their_messages():
    from braid.runtime.attention import create_backend
    from braid.runtime.constrained import get_grammar_backend
    from braid.runtime.constrained.outlines_backend import OutlinesBackend
    from braid.runtime.function_call import get_parser
    from braid.runtime.models import get_model_class
    from braid.runtime.models.llama import LlamaForCausalLM

    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class(arch) is LlamaForCausalLM
    assert get_grammar_backend("outlines") is OutlinesBackend
    with pytest.raises(ValueError, match=r"architecture 'GPT2LMHeadModel' is not supported"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"attention_backend 'flash' is unknown \(have \["):
        create_backend("flash")
    with pytest.raises(ValueError, match=r"tool_call_parser: 'qwen9' is unknown \(have \["):
        get_parser("qwen9")
    with pytest.raises(ValueError, match=r"grammar_backend 'guidance' is unknown"):
        get_grammar_backend("guidance")
    from braid.runtime.scheduler.policies import create_policy, policy_names
    from braid.runtime.scheduler.policy import SchedulePolicy

    for name in policy_names():  # each name is its own policy, and says which it is
        made = create_policy(name)
        assert isinstance(made, SchedulePolicy) and made.name == name
    with pytest.raises(ValueError, match=r"schedule_policy 'lifo' is unknown \(have \["):
        create_policy("lifo")
