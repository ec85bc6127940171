"""Follow one config option from the trainer's command line through the code, and count the files the walk crosses
and the climbs back up the import layers (`pyproject.toml`'s import-linter layers contract, docs/design.md).

    python scripts/option_walk.py parallelism.expert_parallel_comm_backend [--entry torchtitan/train.py:main] [-v]

Static: it reads the source (ast) and runs nothing. From the entry it follows every call into the project's code, in
the order the code is written, and keeps the functions that meet the option: that read it (`X.<field>`), that are
handed the config holding it, the option, or a value made from it (a call's result given any of those, or a method's
result on one, e.g. the exchange backend object), and the functions that hand those down to them. Values are tracked
by name and by attribute (a dataclass built with the value in a field holds it in that field only); a method call on
an object whose class is known (annotations, constructors) follows the method in that class and every override (all
backends). The walk is the list of those functions in the order they are entered; a file is counted once, a climb is
a step from one function to the next whose package sits on a higher layer (a reader going back up to follow on).
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "torchtitan"
CONFIG_CLASS = "JobConfig"
Carry = frozenset  # of tuple[str, ...]: attribute paths from a value to something made from the option; () itself
EMPTY: frozenset = frozenset()
ITSELF: frozenset = frozenset({()})


@dataclass(eq=False)
class Module:
    name: str
    path: Path
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (module, attribute or None)
    annotations: dict[str, ast.expr] = field(default_factory=dict)
    partials: dict[str, str] = field(default_factory=dict)  # `name = partial(function, ...)`: name -> function


@dataclass(eq=False)
class Class:
    module: Module
    node: ast.ClassDef
    methods: dict[str, Func] = field(default_factory=dict)
    fields: dict[str, ast.expr] = field(default_factory=dict)  # annotated attributes, in order
    attrs: dict[str, frozenset] = field(default_factory=dict)  # what `self.x = ...` stored, over the walk

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(eq=False)
class Func:
    module: Module
    node: ast.FunctionDef
    owner: Class | None = None
    nested: dict[str, ast.FunctionDef] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.owner.name}.{self.node.name}" if self.owner else self.node.name

    @property
    def kind(self) -> str:
        names = {d.id for d in self.node.decorator_list if isinstance(d, ast.Name)}
        return "classmethod" if "classmethod" in names else "staticmethod" if "staticmethod" in names else "plain"


@dataclass
class Stay:
    func: Func
    children: list[Stay] = field(default_factory=list)


class Project:
    """The package's modules, classes and functions, and the import layers."""

    def __init__(self, root: Path):
        self.modules: dict[str, Module] = {}
        self.classes: list[Class] = []
        for path in sorted((root / PACKAGE).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            module = Module(name, path, _parse(path.read_text()))
            self.modules[name] = self._index(module, is_package=path.name == "__init__.py")
        config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        (layers,) = [c["layers"] for c in config if c["type"] == "layers"]
        self.layers = [[name.strip() for name in layer.split("|")] for layer in layers]
        self._calls: dict[str, list[tuple[Module, ast.Call]]] | None = None

    def calls_of(self, name: str) -> list[tuple[Module, ast.Call]]:
        """Every call in the package whose callee ends in `name` (`name(...)`, `x.name(...)`), in module and source
        order; indexed on first use."""
        if self._calls is None:
            self._calls = {}
            for module in self.modules.values():
                for node in ast.walk(module.tree):
                    if isinstance(node, ast.Call):
                        callee = ast.unparse(node.func).split(".")[-1]
                        self._calls.setdefault(callee, []).append((module, node))
        return self._calls.get(name, [])

    def _index(self, module: Module, is_package: bool) -> Module:
        package = module.name if is_package else module.name.rpartition(".")[0]
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    module.imports[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
        for node in module.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.defs[node.name] = Func(module, node)
            elif isinstance(node, ast.ClassDef):
                module.defs[node.name] = self._class(module, node)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                module.annotations[node.target.id] = node.annotation
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func).split(".")[-1] == "partial"
                and node.value.args
                and isinstance(node.value.args[0], ast.Name)
            ):
                module.partials[node.targets[0].id] = node.value.args[0].id
        return module

    def _class(self, module: Module, node: ast.ClassDef) -> Class:
        cls = Class(module, node)
        self.classes.append(cls)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cls.methods[item.name] = Func(module, item, cls)
                for sub in ast.walk(item):  # `self.x: T = ...` in a method
                    if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Attribute):
                        cls.fields.setdefault(sub.target.attr, sub.annotation)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                if "ClassVar" not in ast.unparse(item.annotation):
                    cls.fields[item.target.id] = item.annotation
        return cls

    def lookup(self, module: Module, name: str) -> object | None:
        """What `name` is in `module`: a Func, a Class, a Module of the package, or None (outside the package)."""
        if name in module.defs:
            return module.defs[name]
        if name in module.partials:  # the function it binds arguments of (they carry no option)
            return self.lookup(module, module.partials[name])
        if name not in module.imports:
            return None
        source, attribute = module.imports[name]
        if attribute is None:
            return self.modules.get(source)
        if f"{source}.{attribute}" in self.modules:
            return self.modules[f"{source}.{attribute}"]
        target = self.modules.get(source)
        return self.lookup(target, attribute) if target is not None and target is not module else None

    def bases(self, cls: Class) -> list[Class]:
        found = [self.lookup(cls.module, ast.unparse(base).split(".")[-1]) for base in cls.node.bases]
        return [base for base in found if isinstance(base, Class)]

    def mro(self, cls: Class) -> Iterator[Class]:
        yield cls
        for base in self.bases(cls):
            yield from self.mro(base)

    def subclasses(self, cls: Class) -> list[Class]:
        return [other for other in self.classes if other is not cls and cls in list(self.mro(other))]

    def layer(self, module: str) -> int:
        for index, names in enumerate(self.layers):
            if any(module == name or module.startswith(name + ".") for name in names):
                return index
        return len(self.layers)

    def types(self, annotation: ast.expr | None, module: Module) -> set[tuple[str, Class]]:
        """("instance" | "class", class) of an annotation: `X`, `X | None`, `type[X]`, the value of `dict[K, V]`."""
        if annotation is None:
            return set()
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            return self.types(ast.parse(annotation.value, mode="eval").body, module)
        if isinstance(annotation, ast.BinOp):
            return self.types(annotation.left, module) | self.types(annotation.right, module)
        if isinstance(annotation, ast.Subscript):
            outer = ast.unparse(annotation.value)
            inner = annotation.slice.elts[-1] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
            if outer == "type":
                return {("class", cls) for _, cls in self.types(inner, module)}
            return self.types(inner, module) if outer in ("Optional", "ClassVar", "dict") else set()
        if isinstance(annotation, ast.Name):
            found = self.lookup(module, annotation.id)
            return {("instance", found)} if isinstance(found, Class) else set()
        return set()


class Walk:
    """The walk of one option (`section.field`) from an entry function."""

    def __init__(self, project: Project, key: str):
        self.project = project
        self.key_path = tuple(key.split("."))
        self.field = self.key_path[-1]
        self.memo: dict[tuple, tuple[bool, frozenset, Stay]] = {}
        self.active: set[tuple] = set()
        self.readers: dict[tuple[Module, str], None] = {}  # (module, function) of each reader, in walk order

    def call(self, func: Func, bound: dict[str, frozenset], extra: tuple = ()) -> tuple[bool, frozenset, Stay]:
        """Walk `func` with its parameters holding `bound` (and its *args, one by one, `extra`) -> (whether it meets
        the option, what it returns, its stay with the stays of the calls that meet it)."""
        owner_attrs = tuple(sorted((k, v) for k, v in func.owner.attrs.items())) if func.owner else ()
        key = (id(func.node), tuple(sorted(bound.items())), extra, owner_attrs)
        if key in self.memo:
            return self.memo[key]
        if key in self.active:
            return False, EMPTY, Stay(func)
        self.active.add(key)
        frame = Frame(self, func, dict(bound))
        if func.node.args.vararg is not None:
            frame.extra[func.node.args.vararg.arg] = list(extra)
        frame.run(func.node.body)
        self.active.discard(key)
        result = (frame.met, frozenset(frame.returned), Stay(func, frame.children))
        self.memo[key] = result
        return result


class Frame:
    """One function's walk: its names and what they hold, statement by statement."""

    def __init__(self, walk: Walk, func: Func, env: dict[str, frozenset]):
        self.walk, self.project, self.func, self.module = walk, walk.project, func, func.module
        self.env = env
        self.extra: dict[str, list[frozenset]] = {}  # *args, one by one
        self.met = any(() in carry for carry in env.values())
        self.returned: set = set()
        self.children: list[Stay] = []
        self.types: dict[str, set[tuple[str, Class]]] = {}
        args = func.node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        for param in params:
            self.types[param.arg] = self.project.types(param.annotation, self.module)
        if func.owner is not None and params and func.kind != "staticmethod":
            kind = "class" if func.kind == "classmethod" else "instance"
            self.types[params[0].arg] = {(kind, func.owner)}
        for node in ast.walk(func.node):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not func.node:
                func.nested[node.name] = node

    # statements
    def run(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        match node:
            case ast.Expr(value=value) | ast.Raise(exc=value) if value is not None:
                self.value(value)
            case ast.Assign(targets=targets, value=value):
                carry, types = self.value(value), self.type_of(value)
                for target in targets:
                    self.bind(target, carry, types)
            case ast.AnnAssign(target=target, value=value, annotation=annotation):
                carry = self.value(value) if value is not None else EMPTY
                self.bind(target, carry, self.project.types(annotation, self.module) or self.type_of(value))
            case ast.AugAssign(target=target, value=value):
                self.bind(target, self.value(value) | self.value(target), set())
            case ast.Return(value=value) if value is not None:
                self.returned |= self.value(value)
            case ast.If(test=test, body=body, orelse=orelse) | ast.While(test=test, body=body, orelse=orelse):
                self.value(test)
                self.run(body)
                self.run(orelse)
            case ast.For(target=target, iter=iterable, body=body, orelse=orelse):
                self.bind(target, self.value(iterable), set())
                self.run(body)
                self.run(orelse)
            case ast.With(items=items, body=body):
                for item in items:
                    carry = self.value(item.context_expr)
                    if item.optional_vars is not None:
                        self.bind(item.optional_vars, carry, set())
                self.run(body)
            case ast.Try(body=body, handlers=handlers, orelse=orelse, finalbody=finalbody):
                self.run(body)
                for handler in handlers:
                    self.run(handler.body)
                self.run(orelse)
                self.run(finalbody)
            case ast.Assert(test=test, msg=msg):
                self.value(test)
                if msg is not None:
                    self.value(msg)
            case ast.Match(subject=subject, cases=cases):
                self.value(subject)
                for case in cases:
                    self.run(case.body)

    def bind(self, target: ast.expr, carry: frozenset, types: set) -> None:
        match target:
            case ast.Name(id=name):
                self.env[name], self.types[name] = carry, types
            case ast.Tuple(elts=elements) | ast.List(elts=elements):
                for element in elements:
                    self.bind(element, carry, set())
            case ast.Starred(value=value):
                self.bind(value, carry, set())
            case ast.Attribute(value=ast.Name(id=holder), attr=attr):
                held = frozenset((attr, *path) for path in carry)
                self.env[holder] = self.env.get(holder, EMPTY) | held
                owner = self.func.owner
                if owner is not None and holder == self._first_param():
                    owner.attrs[attr] = owner.attrs.get(attr, EMPTY) | carry

    def _first_param(self) -> str | None:
        args = self.func.node.args
        params = [*args.posonlyargs, *args.args]
        return params[0].arg if params else None

    # expressions: what each holds of the option
    def value(self, node: ast.expr | None) -> frozenset:
        carry = self._value(node) if node is not None else EMPTY
        if () in carry:
            self.met = True
        return carry

    def _value(self, node: ast.expr) -> frozenset:
        match node:
            case ast.Name(id=name):
                return self.env.get(name, EMPTY)
            case ast.Attribute(value=value, attr=attr):
                held = self.value(value)
                carry = frozenset(path[1:] for path in held if path and path[0] == attr)
                section = self.walk.key_path[-2] if len(self.walk.key_path) > 1 else None
                if attr == self.walk.field and (() in carry or ast.unparse(value).split(".")[-1] == section):
                    self.walk.readers[(self.module, self.func.label)] = None  # `X.section.field`, whoever X is
                    return ITSELF
                return carry
            case ast.Subscript(value=value, slice=index):
                held, key = self.value(value), self.value(index)
                return held | (ITSELF if () in key else EMPTY)
            case ast.Call():
                return self.call(node)
            case ast.Lambda() | ast.Constant():
                return EMPTY
            case ast.ListComp() | ast.SetComp() | ast.GeneratorExp() | ast.DictComp():
                for generator in node.generators:
                    self.bind(generator.target, self.value(generator.iter), set())
                    for condition in generator.ifs:
                        self.value(condition)
                parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
                return frozenset().union(*(self.value(part) for part in parts))
            case ast.NamedExpr(target=target, value=value):
                carry = self.value(value)
                self.bind(target, carry, set())
                return carry
        return frozenset().union(*(self.value(child) for child in ast.iter_child_nodes(node)
                                   if isinstance(child, ast.expr)))  # fmt: skip

    def call(self, node: ast.Call) -> frozenset:
        receiver = self.value(node.func.value) if isinstance(node.func, ast.Attribute) else EMPTY
        positional = []
        for arg in node.args:
            forwarded = isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name) and arg.value.id in self.extra
            if forwarded:  # f(*args) passes this function's own *args on, one by one
                self.value(arg)
                positional += [(carry, False) for carry in self.extra[arg.value.id]]
            else:
                positional.append((self.value(arg), isinstance(arg, ast.Starred)))
        keywords = {kw.arg: self.value(kw.value) for kw in node.keywords}
        targets = self.targets(node.func, receiver)
        result: frozenset = EMPTY
        for target, self_carry in targets:
            result |= self.enter(target, self_carry, positional, keywords)
        given = [receiver, *(carry for carry, _ in positional), *keywords.values()]
        on_it = any(self_carry is not None and () in self_carry for _, self_carry in targets)
        if on_it or (not targets and any(() in carry for carry in given)):  # asked of it, or made from it elsewhere
            result |= ITSELF
        return result

    def enter(self, target: object, self_carry, positional, keywords) -> frozenset:
        if isinstance(target, Class):
            if target.name == CONFIG_CLASS:
                return frozenset({self.walk.key_path})
            init = next((c.methods["__init__"] for c in self.project.mro(target) if "__init__" in c.methods), None)
            if init is None:  # a dataclass: its fields hold what they are given
                names = list(target.fields)
                held = {name: carry for name, (carry, _) in zip(names, positional, strict=False)} | keywords
                return frozenset((name, *path) for name, carry in held.items() if name for path in carry)
            self._enter(init, EMPTY, positional, keywords)
            return frozenset((name, *path) for name, carry in target.attrs.items() for path in carry)
        returns = self.project.types(target.node.returns, target.module)
        result = self._enter(target, self_carry, positional, keywords)
        if any(cls.name == CONFIG_CLASS for _, cls in returns):
            result |= frozenset({self.walk.key_path})
        return result

    def _enter(self, func: Func, self_carry, positional, keywords) -> frozenset:
        args = func.node.args
        params = [param.arg for param in [*args.posonlyargs, *args.args]]
        bound: dict[str, frozenset] = {}
        if self_carry is not None and params:
            bound[params.pop(0)] = self_carry
        starred = frozenset().union(*(carry for carry, star in positional if star))
        extra = []
        for index, (carry, star) in enumerate(positional):
            if star or index >= len(params):
                if args.vararg is not None:
                    bound[args.vararg.arg] = bound.get(args.vararg.arg, EMPTY) | carry
                    extra.append(carry)
                continue
            bound[params[index]] = carry
        for param in params:
            bound[param] = bound.get(param, EMPTY) | starred
        for name, carry in keywords.items():
            if name in params or name in [p.arg for p in args.kwonlyargs]:
                bound[name] = bound.get(name, EMPTY) | carry
            elif args.kwarg is not None:
                bound[args.kwarg.arg] = bound.get(args.kwarg.arg, EMPTY) | carry
        bound = {name: carry for name, carry in bound.items() if carry}
        met, returned, stay = self.walk.call(func, bound, tuple(extra))
        if met:
            self.met = True
            self.children.append(stay)
        return returned

    def targets(self, callee: ast.expr, receiver: frozenset) -> list[tuple[object, frozenset | None]]:
        """The project's functions or classes a call may run, each with what its `self` / `cls` holds."""
        if isinstance(callee, ast.Name):
            if callee.id in self.func.nested:
                return [(Func(self.module, self.func.nested[callee.id], self.func.owner), None)]
            found = self.project.lookup(self.module, callee.id)
            if isinstance(found, (Func, Class)):
                return [(found, None)]
            return [(cls, None) for kind, cls in self.types.get(callee.id, set()) if kind == "class"]
        if not isinstance(callee, ast.Attribute):
            return []
        if isinstance(callee.value, ast.Name):  # module.function
            found = self.project.lookup(self.module, callee.value.id)
            if isinstance(found, Module):
                target = self.project.lookup(found, callee.attr)
                return [(target, None)] if isinstance(target, (Func, Class)) else []
        targets = []
        for kind, cls in self.type_of(callee.value):
            classes = [*self.project.mro(cls)]
            method = next((c.methods[callee.attr] for c in classes if callee.attr in c.methods), None)
            if method is None:
                targets += [(func, None) for func in self.field_functions(cls, callee.attr)]
                continue
            for func in [method, *(s.methods[callee.attr] for s in self.project.subclasses(cls)
                                   if callee.attr in s.methods)]:  # fmt: skip
                bound = None if func.kind == "staticmethod" else receiver
                if kind == "class" and func.kind == "plain":
                    bound = None
                targets.append((func, bound))
        return targets

    def field_functions(self, cls: Class, name: str) -> list[Func]:
        """Functions given as `name=` where `cls` is built (a dataclass field that holds a callable)."""
        found = []
        for module, node in self.project.calls_of(cls.name):
            for kw in node.keywords:
                if kw.arg == name and isinstance(kw.value, ast.Name):
                    found += self._named_function(module, kw.value.id, node)
        return found

    def _named_function(self, module: Module, name: str, at: ast.AST) -> list[Func]:
        for node in ast.walk(module.tree):  # a function nested in the one that builds the object
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is at for n in ast.walk(node)):
                for inner in node.body:
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.name == name:
                        return [Func(module, inner)]
        found = self.project.lookup(module, name)
        return [found] if isinstance(found, Func) else []

    def type_of(self, node: ast.expr | None) -> set[tuple[str, Class]]:
        if isinstance(node, ast.Name):
            if node.id in self.types:
                return self.types[node.id]
            found = self.project.lookup(self.module, node.id)
            return {("class", found)} if isinstance(found, Class) else set()
        if isinstance(node, ast.Attribute):
            types = set()
            for kind, cls in self.type_of(node.value):
                for owner in self.project.mro(cls):
                    if kind == "instance" and node.attr in owner.fields:
                        types |= self.project.types(owner.fields[node.attr], owner.module)
                        break
            return types
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):  # an item of a module's annotated dict
            return self.project.types(self.module.annotations.get(node.value.id), self.module)
        if isinstance(node, ast.Call):
            types = set()
            for target, _ in self.targets(node.func, EMPTY):
                if isinstance(target, Class):
                    types.add(("instance", target))
                else:
                    types |= self.project.types(target.node.returns, target.module)
            return types
        return set()


@functools.cache
def _parse(source: str) -> ast.Module:
    """A module's tree, parsed once per process for the same source (the walk reads trees and changes none)."""
    return ast.parse(source)


@dataclass
class Step:
    """Consecutive functions of the walk in one file."""

    file: str
    layer: int
    """Its import layer, 1 the lowest."""
    functions: list[str]
    climb: bool
    """Its layer is above the previous step's."""


@dataclass
class Route:
    option: str
    steps: list[Step]
    readers: list[str]
    """file:function of each function that reads the option."""

    @property
    def files(self) -> int:
        return len({step.file for step in self.steps})

    @property
    def climbs(self) -> int:
        return sum(step.climb for step in self.steps)


def walk_option(option: str, entry: str = "torchtitan/train.py:main", root: Path = ROOT) -> Route:
    """The walk of `option` (`section.field`) from `entry` (FILE:FUNCTION) in the project at `root`."""
    project = Project(root)
    path, _, name = entry.partition(":")
    (module,) = [m for m in project.modules.values() if m.path == root / path]
    walk = Walk(project, option)
    _, _, start = walk.call(module.defs[name], {})
    steps: list[Step] = []
    for func in _preorder(start):
        file = str(func.module.path.relative_to(root))
        if steps and steps[-1].file == file:
            steps[-1].functions.append(func.label)
            continue
        layer = len(project.layers) - project.layer(func.module.name)
        steps.append(Step(file, layer, [func.label], climb=bool(steps) and layer > steps[-1].layer))
    readers = [f"{module.path.relative_to(root)}:{label}" for module, label in walk.readers]
    return Route(option, steps, readers)


def _preorder(stay: Stay) -> Iterator[Func]:
    yield stay.func
    for child in stay.children:
        yield from _preorder(child)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("option", help="section.field, e.g. parallelism.expert_parallel_comm_backend")
    parser.add_argument("--entry", default="torchtitan/train.py:main", help="FILE:FUNCTION the walk starts in")
    parser.add_argument("-v", "--verbose", action="store_true", help="name the functions of each step")
    args = parser.parse_args(argv)
    route = walk_option(args.option, args.entry)
    for number, step in enumerate(route.steps, 1):
        names = f"  {', '.join(dict.fromkeys(step.functions))}" if args.verbose else ""
        print(f"{number:3d}. {'UP ' if step.climb else '   '}{step.file} (layer {step.layer}){names}")
    print(f"read by {len(route.readers)}: {', '.join(route.readers)}")
    print(f"{route.option}: {len(route.steps)} steps in {route.files} files, {route.climbs} climbs back up a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
