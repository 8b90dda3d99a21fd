"""The type checker `make typecheck` runs (mypy, [tool.mypy] in pyproject.toml) catches the two
mistakes a typed config is for: a misspelt key read by attribute, and a section passed where a
function takes another. Marked slow: mypy reads torch's and transformers' stubs (a minute or more);
`make test` runs the checker over ridgeline/ itself first."""

import textwrap

import pytest

mypy_api = pytest.importorskip("mypy.api")


@pytest.mark.slow
def test_the_checker_refuses_a_misspelt_key_and_the_wrong_section(tmp_path):
    probe = tmp_path / "probe_cfg.py"
    probe.write_text(textwrap.dedent("""
        from ridgeline.config.schema import RidgelineConfig
        from ridgeline.trainer.builders import load_environments


        def f(cfg: RidgelineConfig) -> bool:
            load_environments(cfg.generator)
            return cfg.trainer.algorithm.use_tiss
    """))
    out, _err, status = mypy_api.run([str(probe)])
    assert status == 1
    assert 'Argument 1 to "load_environments" has incompatible type "GeneratorConfig"; expected ' \
           '"EnvironmentConfig"' in out
    assert '"AlgorithmConfig" has no attribute "use_tiss"; maybe "use_tis"?' in out
