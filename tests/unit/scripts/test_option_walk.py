"""scripts/option_walk.py: the walk of a config option through a small package (its steps, files, climbs back up a
layer and readers), and on this project the exchange backend's name read in one function only, and its settings by
its object alone."""

import textwrap

from scripts.option_walk import walk_option

LOW = """
    from dataclasses import dataclass


    @dataclass
    class JobConfig:
        section: object = None


    class Thing:
        def use(self) -> None:
            pass


    THINGS: dict[str, Thing] = {}


    def parse() -> JobConfig:
        return JobConfig()


    def resolve(job: JobConfig) -> Thing:
        return THINGS[job.section.field]


    def unrelated(job: JobConfig) -> int:
        return 1
"""
TOP = """
    from torchtitan.low import Thing, parse, resolve, unrelated


    def main() -> None:
        job = parse()
        unrelated(job)
        helper(resolve(job))


    def helper(thing: Thing) -> None:
        thing.use()
"""
PYPROJECT = """
    [[tool.importlinter.contracts]]
    name = "layers"
    type = "layers"
    layers = ["torchtitan.top", "torchtitan.low"]
"""


def test_the_walk_follows_the_option_and_the_object_made_from_it(tmp_path):
    package = tmp_path / "torchtitan"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(textwrap.dedent(LOW))
    (package / "top.py").write_text(textwrap.dedent(TOP))
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    route = walk_option("section.field", "torchtitan/top.py:main", root=tmp_path)
    # main, resolve (reads it), back up to helper (handed the object), its method: `unrelated` never meets it
    assert [(step.file, step.functions) for step in route.steps] == [
        ("torchtitan/top.py", ["main"]),
        ("torchtitan/low.py", ["resolve"]),
        ("torchtitan/top.py", ["helper"]),
        ("torchtitan/low.py", ["Thing.use"]),
    ]
    assert [step.climb for step in route.steps] == [False, False, True, False]
    assert (route.files, route.climbs, route.readers) == (2, 1, ["torchtitan/low.py:resolve"])


def test_the_exchange_backend_name_is_read_by_resolve_exchange_alone():
    route = walk_option("parallelism.expert_parallel_comm_backend")
    assert route.readers == ["torchtitan/models/moe/exchange.py:resolve_exchange"]
    files = {step.file for step in route.steps}
    # the spec's parallelize is `partial(parallelize_moe_model, attention_plan=...)`: the walk follows the partial
    assert {"torchtitan/preflight.py", "torchtitan/models/moe/parallelize.py"} <= files
    assert "torchtitan/config/manager.py" not in files


def test_the_deepep_section_is_read_by_the_deepep_backend_alone():
    """Its own section, read by no config check, trainer or parallelize function: the backend holds the values."""
    route = walk_option("deepep.num_sms")
    assert route.readers and {reader.rpartition(".")[0] for reader in route.readers} == {
        "torchtitan/models/moe/exchange.py:DeepEPBackend"
    }
