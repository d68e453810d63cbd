"""The client API reads like the ecosystem's: every public name of producer, consumer and txmq.sync
has a docstring, every public function and method has type hints on its parameters and its return,
and docs/api.md names each of them."""
from __future__ import annotations

import enum
import inspect

import pytest

import consumer
import producer
from tests.support.broker_process import REPO
from txmq import sync

MODULES = {"producer": producer, "consumer": consumer, "txmq.sync": sync}
PUBLIC = [(mod, name) for mod, m in MODULES.items() for name in m.__all__]


def _members(obj):
    for name, value in vars(obj).items():
        if name.startswith("_") and name not in ("__init__",):
            continue
        if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
            yield name, inspect.unwrap(getattr(value, "__func__", value))


def _hint_gaps(fn, owner: str) -> list[str]:
    sig = inspect.signature(fn)
    gaps = [f"{owner}.{fn.__name__}({p})" for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        gaps.append(f"{owner}.{fn.__name__} -> ?")
    return gaps


@pytest.mark.parametrize("module, name", PUBLIC)
def test_public_names_have_docstrings_and_type_hints(module, name):
    obj = getattr(MODULES[module], name)
    assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"
    if inspect.isfunction(obj):
        assert not _hint_gaps(obj, module)
        return
    if not inspect.isclass(obj) or issubclass(obj, enum.Enum) or module == "txmq.sync":
        return
    protocol_class = getattr(obj, "_is_protocol", False)
    missing_doc, gaps = [], []
    for member, fn in _members(obj):
        if protocol_class and member == "__init__":
            continue
        if member != "__init__" and not (fn.__doc__ or "").strip():
            missing_doc.append(f"{name}.{member}")
        gaps += _hint_gaps(fn, name)
    assert not missing_doc, f"no docstring: {missing_doc}"
    assert not gaps, f"no type hints: {gaps}"


def test_api_reference_names_every_public_name():
    text = (REPO / "docs" / "api.md").read_text()
    missing = [f"{m}.{n}" for m, n in PUBLIC if f"`{n}" not in text]
    assert not missing, missing


def test_our_selector_names_the_tags_java_would():
    """Our consumers' heartbeat tagsSet (and their own check of what a pull gave) trimmed the same way: an
    empty tag ("a ||") is none, as FilterAPI skips it."""
    assert consumer.MessageSelector.by_tag("TagA\u3000 || \u0010B ||").tags == ["TagA\u3000", "B"]
    assert consumer.MessageSelector.by_tag(" * ").tags == ["*"]     # FilterAPI: the tag "*", not every message
    assert consumer.MessageSelector.by_tag("").tags == []
    for no_tag in (" ", "||", " || "):      # a broker refuses its pulls: refused at subscribe instead
        with pytest.raises(ValueError, match="names no tag"):
            consumer.MessageSelector.by_tag(no_tag)


def test_a_push_consumer_refuses_a_tag_expression_of_no_tag_at_subscribe():
    """docs/compatibility.md: our consumers refuse an expression naming no tag at subscribe, as the Java client
    refuses "||" there. The push consumer only stored it and raised at start(), after fetching routes."""
    push = consumer.PushConsumer("127.0.0.1:1", "G", lambda msg: None)
    for no_tag in (" ", "||", " || "):
        with pytest.raises(ValueError, match="names no tag"):
            push.subscribe("T", no_tag)
    assert push.subscriptions == {}
    push.subscribe("T", " * ")
    assert push.subscriptions == {"T": " * "}


def test_a_tag_selector_of_no_tag_built_directly_is_refused_too():
    """MessageSelector is a public dataclass: MessageSelector(" ") (or (" ", "TAG")) skipped by_tag's check, so
    a push consumer subscribed with it, started, stored its consume_from="last" start on each queue and then had
    every pull refused (SUBSCRIPTION_PARSE_FAILED), the refusal at subscribe bypassed."""
    push = consumer.PushConsumer("127.0.0.1:1", "G", lambda msg: None)
    for no_tag in (" ", "||", " || "):
        with pytest.raises(ValueError, match="names no tag"):
            push.subscribe("T", consumer.MessageSelector(no_tag))
        with pytest.raises(ValueError, match="names no tag"):
            consumer.MessageSelector(no_tag, "TAG")
    assert push.subscriptions == {}
    assert consumer.MessageSelector("").tags == [] and consumer.MessageSelector(" * ").tags == ["*"]
