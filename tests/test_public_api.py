"""tutorial_lib's top level is its public API: every exported name exists and says what it is."""

import inspect

import tutorial_lib


def test_every_exported_name_exists():
    missing = [n for n in tutorial_lib.__all__ if not hasattr(tutorial_lib, n)]
    assert not missing, missing
    assert len(set(tutorial_lib.__all__)) == len(tutorial_lib.__all__), "a name is exported twice"


def test_every_exported_function_and_class_is_documented():
    undocumented = [n for n in tutorial_lib.__all__
                    if (inspect.isfunction(obj := getattr(tutorial_lib, n)) or inspect.isclass(obj))
                    and not (inspect.getdoc(obj) or "").strip()]
    assert not undocumented, f"exported without a docstring: {undocumented}"


def test_setup_is_idempotent():
    tutorial_lib.setup()
    tutorial_lib.setup()
    assert hasattr(tutorial_lib.QuantizedTensor, "fsdp_pre_all_gather")
