"""The scan of ``tests/packaging/test_op_specs.py``: positional reads of memopt graph ops' arguments (issue 38).

Every function a rewritten graph calls (``memopt.core.leaf.graph_leaf``) takes its non-tensor parameters as one typed
spec, a NamedTuple (``ChainSpec``, ``FromStashSpec``, ``FromCodesSpec``, ``EncodeSpec``, ``FewBitSpec``, ...), whose
``of(node)`` reads it off a call node; ``memopt.core.leaf.argument(node, name)`` reads any other argument by name.
Both bind the node's args to the op's own signature, so a changed signature cannot make a reader pick the wrong
argument, where ``conv.args[13]`` silently would. ``Project(...).findings()`` lists the reads of a graph op node's
args by position in the sources given (the test gives passes/, memopt/ and cost_model/): ``X.args[<int>]``,
``X.args[<slice>]``, ``a, b = X.args``, or an alias ``args = X.args`` read so. Reads of ATen / torch calls' args are
left alone.

A variable holds a graph op node where the code itself says so (``Flow``), following the control flow of each
function (so that ``if nxt.target is not bn_act_stash: <read an add's args>`` is not taken for a read of the op):
  1. after a comparison of ``X.target`` with an op holds: ``is`` / ``==`` / ``in`` (a literal of ops, or a name bound
     to one anywhere in the project, as ``CONSUMERS``) in an ``if`` body, an ``and``'s later operands, a
     comprehension's element; ``is not`` / ``!=`` / ``not in`` after a guard that leaves (return, continue, raise,
     break) and in an ``or``'s later operands;
  2. after X is made as an op's call: ``graph.create_node("call_function", op, ...)``, ``graph.call_function(op, ...)``;
  3. in a project function's parameter, when a caller passes it a variable that holds an op node there;
  4. after a call of a project predicate holds (a function whose every non-false return has its parameter holding an
     op node: ``_chain_without_residual(first)``), as a comparison does;
  5. in a variable unpacked from a call of a project function that returns, yields or appends op nodes at that
     position (``for first, conv, following in _identity_links(...)``).
Rules 3-5 follow imports between project modules, to a fixed point. What they cannot see is not checked: a node
reached through a method call or a container filled elsewhere, a target compared by its name string, a variable that
may hold an op node or another call at the read (``following.args[:1]`` in ``_identity_links``: the first input of a
BatchNorm or of a chain).
"""
from __future__ import annotations

import ast
from typing import Dict, List, Optional, Tuple

EXITS = (ast.Return, ast.Continue, ast.Raise, ast.Break)
POSITIVE, NEGATIVE = (ast.Is, ast.Eq, ast.In), (ast.IsNot, ast.NotEq, ast.NotIn)
Known = Dict[str, Tuple[frozenset, str]]  # variable -> (the ops its node may call, why the test thinks so)

# the spec helpers: the only functions that may touch a graph op node's args by position (set_argument writes the
# position the op's signature gives the name; every reader binds by name)
SPEC_HELPERS = {("memopt.core.leaf", "set_argument")}


class Project:
    """The sources, their graph ops and what ``Flow`` finds in every function, to a fixed point."""

    def __init__(self, sources: Dict[str, Tuple[str, str]]) -> None:
        """``sources``: {module name: (path to print, source text)}."""
        self.paths = {m: p for m, (p, _) in sources.items()}
        trees = {m: ast.parse(text, p) for m, (p, text) in sources.items()}
        self.ops: Dict[str, ast.FunctionDef] = {}
        self.functions: Dict[Tuple[str, str], ast.FunctionDef] = {}
        self.imports: Dict[str, Dict[str, Tuple[str, str]]] = {}
        self.scopes: List[Tuple[str, ast.FunctionDef]] = []
        for module, tree in trees.items():
            self.imports[module] = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                                    if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.scopes.append((module, node))
                    if any(isinstance(d, ast.Name) and d.id == "graph_leaf" for d in node.decorator_list):
                        self.ops[node.name] = node
            self.functions.update({(module, n.name): n for n in tree.body if isinstance(n, ast.FunctionDef)})
        self.collections = {t.id: ops for tree in trees.values() for n in tree.body if isinstance(n, ast.Assign)
                            for ops in [self.op_of(n.value)] if ops for t in n.targets if isinstance(t, ast.Name)}
        self.params: Dict[int, Known] = {}  # rule 3
        self.predicates: Dict[int, Known] = {}  # rule 4
        self.returns: Dict[int, Dict[Optional[int], Tuple[frozenset, str]]] = {}  # rule 5: position -> (ops, why)
        self.flows: Dict[int, Flow] = {}
        for _ in range(100):  # each round only adds facts: a fixed point within a few rounds
            before = self._state()
            for module, fn in self.scopes:
                self.flows[id(fn)] = Flow(self, module, fn)
            if self._state() == before:
                return
        raise AssertionError("rules 3-5 found no fixed point in 100 rounds")

    def _state(self):
        return [sorted((k, str(p), tuple(sorted(ops))) for k, found in table.items() for p, (ops, _) in found.items())
                for table in (self.params, self.predicates, self.returns)]

    def op_of(self, expr, local: Optional[Dict[str, frozenset]] = None) -> frozenset:
        """The ops ``expr`` names: an op, a name bound to ops, a conditional of them, a literal of them."""
        if isinstance(expr, ast.Name):
            return frozenset({expr.id}) if expr.id in self.ops else (local or {}).get(expr.id, frozenset())
        if isinstance(expr, ast.Attribute):
            return frozenset({expr.attr}) if expr.attr in self.ops else frozenset()
        if isinstance(expr, ast.IfExp):
            return self.op_of(expr.body, local) | self.op_of(expr.orelse, local)
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            return frozenset().union(*(self.op_of(e, local) for e in expr.elts))
        return frozenset()

    def callee(self, module: str, call: ast.Call) -> Optional[ast.FunctionDef]:
        if not isinstance(call.func, ast.Name):
            return None
        found = self.functions.get((module, call.func.id))
        source = self.imports[module].get(call.func.id)
        return found if found is not None or source is None else self.functions.get(source)

    def findings(self) -> List[str]:
        out = {}
        for module, fn in self.scopes:
            if (module, fn.name) in SPEC_HELPERS:
                continue
            for line, col, text in self.flows[id(fn)].reads:
                out[(self.paths[module], line, col)] = f"{self.paths[module]}:{line}: {text}"
        return [out[k] for k in sorted(out)]

    def fixes(self, op: str, var: str, what) -> List[str]:
        fn = self.ops[op]
        picked = _picked([a.arg for a in fn.args.posonlyargs + fn.args.args],
                         fn.args.vararg.arg if fn.args.vararg is not None else None, what)
        annotations = {a.arg: a.annotation for a in fn.args.args}
        if not picked:  # a read left from an older signature
            spec = annotations.get("spec")
            return [f"{op} has no argument at position {ast.unparse(what)} (it takes "
                    f"{', '.join(a.arg for a in fn.args.args)})"
                    + (f"; {spec.id}.of({var}) for its spec" if isinstance(spec, ast.Name) else "")]
        return [f"{annotations[n].id}.of({var}) for {op}'s spec" if n == "spec" and
                isinstance(annotations.get(n), ast.Name) else
                f'memopt.core.leaf.argument({var}, "{n}") for {op}\'s {n}' for n in picked]


def _bind(fn: ast.FunctionDef, call: ast.Call) -> List[Tuple[str, ast.expr]]:
    """(parameter, argument) pairs of ``call`` to ``fn``, up to the first starred argument."""
    pairs = []
    for name, arg in zip([a.arg for a in fn.args.posonlyargs + fn.args.args], call.args):
        if isinstance(arg, ast.Starred):
            break
        pairs.append((name, arg))
    return pairs + [(k.arg, k.value) for k in call.keywords if k.arg is not None]


class Flow:
    """One function walked in order with the variables known to hold graph op nodes at each point (``known``);
    records the positional reads of those (``reads``) and feeds rules 3-5 into the project."""

    def __init__(self, project: Project, module: str, fn: ast.FunctionDef) -> None:
        self.project, self.module, self.fn = project, module, fn
        self.reads: List[Tuple[int, int, str]] = []
        self.aliases: Dict[str, str] = {}
        self.local: Dict[str, frozenset] = {}  # names bound to ops (target = conv_from_stash if ... else ...)
        self.returns: List[Tuple[Optional[ast.expr], Known]] = []  # each return's value, what is known there
        self.gives: List[Tuple[ast.expr, Known]] = []  # values returned, yielded or appended (rule 5)
        self.inner: Dict[int, Known] = {}  # what a comprehension's element knows
        self.entry = dict(project.params.get(id(fn), {}))
        self.block(fn.body, dict(self.entry))
        self._conclude()

    # -- statements: each returns what is known after it, None when it never falls through
    def block(self, body, known: Optional[Known]) -> Optional[Known]:
        for stmt in body:
            if known is None:
                return None
            known = self.stmt(stmt, known)
        return known

    def stmt(self, s, known: Known) -> Optional[Known]:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return known  # its own scope
        if isinstance(s, ast.If):
            self.expr(s.test, known)
            yes = self.block(s.body, {**known, **self.facts(s.test, True, known)})
            no = self.block(s.orelse, {**known, **self.facts(s.test, False, known)})
            return _merge(yes, no)
        if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            self.expr(s.iter if not isinstance(s, ast.While) else s.test, known)
            inner = dict(known)
            if not isinstance(s, ast.While):
                self.bind(s.target, s.iter, inner)
            self.block(s.body, inner)
            self.block(s.orelse, dict(known))
            return _forget(known, s)
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return self.assign(s, known)
        if isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self.expr(item.context_expr, known)
            return self.block(s.body, known)
        if isinstance(s, ast.Try):
            after = self.block(s.body, dict(known))
            for handler in s.handlers:
                self.block(handler.body, _forget(known, s))
            self.block(s.orelse, after)
            self.block(s.finalbody, _forget(known, s))
            return _forget(known, s) if s.handlers else after
        for child in ast.iter_child_nodes(s):
            if isinstance(child, ast.expr):
                self.expr(child, known)
        if isinstance(s, ast.Return):
            self.returns.append((s.value, dict(known)))
            if s.value is not None:
                self.gives.append((s.value, dict(known)))
        return None if isinstance(s, EXITS) else known

    def assign(self, s, known: Known) -> Known:
        value = s.value
        if value is None:
            return known
        self.expr(value, known)
        targets = s.targets if isinstance(s, ast.Assign) else [s.target]
        if any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):
            self.read(s, _args_of(value), "all", known)
        known = _forget(known, s)
        for target in targets:
            if isinstance(target, ast.Name):
                if _args_of(value) in known:
                    self.aliases[target.id] = _args_of(value)
                ops = self.project.op_of(value, self.local) if not isinstance(value, ast.Tuple) else frozenset()
                if ops:
                    self.local[target.id] = ops
                made = isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and \
                    value.func.attr in ("create_node", "call_function") and \
                    frozenset().union(*(self.project.op_of(a, self.local) for a in value.args[:2]))
                if made:
                    known[target.id] = (made, f"made as a {_names(made)} call at line {s.lineno}")
            self.bind(target, value, known)
        return known

    def bind(self, target, value, known: Known) -> None:
        """Rule 5: ``target`` = a call of a project function that returns op nodes (at those positions)."""
        callee = self.project.callee(self.module, value) if isinstance(value, ast.Call) else None
        returned = self.project.returns.get(id(callee), {}) if callee is not None else {}
        pairs = [(None, target)] if isinstance(target, ast.Name) else \
            list(enumerate(target.elts)) if isinstance(target, (ast.Tuple, ast.List)) else []
        for index, name in pairs:
            if index in returned and isinstance(name, ast.Name):
                ops, why = returned[index]
                known[name.id] = (ops, f"{callee.name}() gives it at line {value.lineno} ({why})")

    # -- expressions
    def expr(self, e, known: Known) -> None:
        if isinstance(e, ast.BoolOp):
            known = dict(known)
            for operand in e.values:
                self.expr(operand, known)
                known.update(self.facts(operand, isinstance(e.op, ast.And), known))
            return
        if isinstance(e, ast.IfExp):
            self.expr(e.test, known)
            self.expr(e.body, {**known, **self.facts(e.test, True, known)})
            self.expr(e.orelse, {**known, **self.facts(e.test, False, known)})
            return
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = dict(known)
            for gen in e.generators:
                self.expr(gen.iter, inner)
                self.bind(gen.target, gen.iter, inner)
                for condition in gen.ifs:
                    self.expr(condition, inner)
                    inner.update(self.facts(condition, True, inner))
            for part in ([e.key, e.value] if isinstance(e, ast.DictComp) else [e.elt]):
                self.expr(part, inner)
            self.inner[id(e)] = inner
            return
        if isinstance(e, (ast.Yield, ast.YieldFrom)) and e.value is not None:
            self.gives.append((e.value, dict(known)))
        if isinstance(e, ast.Subscript) and _positional(e.slice):
            self.read(e, _args_of(e.value) or self.aliases.get(getattr(e.value, "id", None)), e.slice, known)
        if isinstance(e, ast.Call):
            self.call(e, known)
        if isinstance(e, ast.Lambda):
            return self.expr(e.body, known)
        for child in ast.iter_child_nodes(e):
            if isinstance(child, (ast.expr, ast.keyword)):
                self.expr(child.value if isinstance(child, ast.keyword) else child, known)

    def call(self, call: ast.Call, known: Known) -> None:
        """Rule 3 into the callee; an ``append`` of op nodes counts as returned (rule 5)."""
        if isinstance(call.func, ast.Attribute) and call.func.attr == "append" and len(call.args) == 1:
            self.gives.append((call.args[0], dict(known)))
        callee = self.project.callee(self.module, call)
        for param, arg in _bind(callee, call) if callee is not None else ():
            if isinstance(arg, ast.Name) and arg.id in known:
                ops, why = known[arg.id]
                self.project.params.setdefault(id(callee), {}).setdefault(
                    param, (ops, f"{self.fn.name}() passes {arg.id} at line {call.lineno}, where {why}"))

    def facts(self, test, holds: bool, known: Known) -> Known:
        """What ``test`` being ``holds`` tells: {variable: (ops, why)}."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.facts(test.operand, not holds, known)
        if isinstance(test, ast.BoolOp):
            if isinstance(test.op, ast.And) != holds:
                return {}  # a false `and` or a true `or`: no operand is known to hold
            found: Known = {}
            for operand in test.values:
                found.update(self.facts(operand, holds, {**known, **found}))
            return found
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], POSITIVE + NEGATIVE):
            left = test.left
            var = left.value.id if isinstance(left, ast.Attribute) and left.attr == "target" and \
                isinstance(left.value, ast.Name) else None
            right = test.comparators[0]
            ops = self.project.op_of(right, self.local) or (
                self.project.collections.get(right.id, frozenset()) if isinstance(right, ast.Name) else frozenset())
            if var is not None and ops and isinstance(test.ops[0], POSITIVE) == holds:
                return {var: (ops, f"line {test.lineno} checks its target is {_names(ops)}")}
        if isinstance(test, ast.Call) and holds:
            callee = self.project.callee(self.module, test)
            asserted = self.project.predicates.get(id(callee), {}) if callee is not None else {}
            return {arg.id: (asserted[p][0], f"{callee.name}() at line {test.lineno} checks it is "
                                             f"{_names(asserted[p][0])}")
                    for p, arg in _bind(callee, test) if p in asserted and isinstance(arg, ast.Name)} \
                if asserted else {}
        return {}

    def read(self, node, var: Optional[str], what, known: Known) -> None:
        if var not in known:
            return
        ops, why = known[var]
        fixes = sorted({fix for op in ops for fix in self.project.fixes(op, var, what)})
        fixes = fixes[:6] + ([f"... ({len(fixes) - 6} more arguments)"] if len(fixes) > 6 else [])
        self.reads.append((node.lineno, node.col_offset,
                           f"`{ast.unparse(node)[:100]}` reads a memopt graph op's arguments by position ({var} holds "
                           f"a {_names(ops)} node: {why}). Read them by name through the op's spec helper: "
                           + "; ".join(fixes)))

    def _conclude(self) -> None:
        """Rule 4: the parameters that every return of a true value finds holding op nodes by this function's own
        checks (not by what callers pass: that would spread to every caller); rule 5: the positions of what it
        returns, yields or appends that are op nodes (of a comprehension: its element)."""
        params = [a.arg for a in self.fn.args.posonlyargs + self.fn.args.args]
        live = [k for v, k in self.returns if v is not None and not (isinstance(v, ast.Constant) and not v.value)]
        self.project.predicates[id(self.fn)] = {p: live[0][p] for p in params if live and all(
            p in k and k[p] is not self.entry.get(p) for k in live)}
        found = self.project.returns.setdefault(id(self.fn), {})
        for value, known in self.gives:
            if isinstance(value, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
                value, known = value.elt, self.inner.get(id(value), {})
            pairs = [(None, value)] if isinstance(value, ast.Name) else \
                list(enumerate(value.elts)) if isinstance(value, ast.Tuple) else []
            for index, name in pairs:
                if isinstance(name, ast.Name) and name.id in known and index not in found:
                    found[index] = known[name.id]


def _merge(a: Optional[Known], b: Optional[Known]) -> Optional[Known]:
    if a is None or b is None:
        return b if a is None else a
    return {k: v for k, v in a.items() if k in b}


def _forget(known: Known, s) -> Known:
    """``known`` less the names ``s`` assigns."""
    assigned = {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {k: v for k, v in known.items() if k not in assigned}


def _names(ops) -> str:
    return " / ".join(sorted(ops))


def _args_of(expr) -> Optional[str]:
    """X for ``X.args``."""
    if isinstance(expr, ast.Attribute) and expr.attr == "args" and isinstance(expr.value, ast.Name):
        return expr.value.id
    return None


def _int(expr) -> Optional[int]:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, int) and not isinstance(expr.value, bool):
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and _int(expr.operand) is not None:
        return -_int(expr.operand)
    return None


def _positional(index) -> bool:
    return isinstance(index, ast.Slice) or _int(index) is not None


def _picked(names: List[str], rest: Optional[str], what) -> List[str]:
    """The parameters a positional read takes: ``what`` is "all" (unpacking), a slice or an index; ``rest``: the
    ``*inputs`` parameter that takes every position past ``names``."""
    tail = [rest] if rest is not None else []
    if isinstance(what, ast.Slice):
        low, high = (_int(b) if b is not None else d for b, d in ((what.lower, 0), (what.upper, len(names) + 1)))
        if low is None or high is None or low < 0 or high < 0:
            return names + tail
        return names[low:high] + (tail if high > len(names) else [])
    index = None if what == "all" else _int(what)
    if index is None or index < 0:
        return names + tail
    return [names[index]] if index < len(names) else tail
