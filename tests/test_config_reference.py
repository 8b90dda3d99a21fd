"""docs/config_reference.md is what `python -m ridgeline.config.reference` writes from the schema."""

from ridgeline.config.reference import REFERENCE, reference_text


def test_the_generated_key_reference_is_current():
    assert REFERENCE.read_text(encoding="utf-8") == reference_text(), (
        "docs/config_reference.md is stale: run `python -m ridgeline.config.reference` and commit the result")


def test_the_reference_lists_every_key_with_its_default():
    from ridgeline.config.schema import leaf_fields

    text = REFERENCE.read_text(encoding="utf-8")
    assert [key for key, _, _ in leaf_fields() if f"| `{key}` |" not in text] == []
    assert "| `trainer.algorithm.use_tis` | bool | `false` |" in text
