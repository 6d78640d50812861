"""The rule module: plugins parse the node policy; a change re-applies settings to all pods.

Like koordlet's ``rule`` package: each rule has a parse function that takes the new policy
and says whether *its* view changed; when at least one did, every update callback runs
(the hook server's callback reconciles all known pods).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from krproxy import log

from ._policy import NodePolicy

LOGGER = logging.getLogger("krproxy.hookserver.rules")


@attrs.frozen
class Rule:
    """A registered rule. Strictly read-only."""

    name: str
    description: str
    parse: Callable[[NodePolicy], bool] = attrs.field(hash=False)
    system_supported: Callable[[], bool] = attrs.field(default=lambda: True, hash=False)


@attrs.define
class Rules:
    _rules: dict[str, Rule] = attrs.Factory(dict)
    _callbacks: list[Callable[[], object]] = attrs.Factory(list)

    def register(
        self,
        name: str,
        description: str,
        parse: Callable[[NodePolicy], bool],
        *,
        system_supported: Callable[[], bool] | None = None,
    ) -> None:
        if name in self._rules:
            raise ValueError(f"rule {name!r} is already registered")
        self._rules[name] = Rule(name, description, parse, system_supported or (lambda: True))

    def on_update(self, callback: Callable[[], object]) -> None:
        self._callbacks.append(callback)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._rules))

    def update(self, policy: NodePolicy) -> tuple[str, ...]:
        """Feed ``policy`` to every supported rule; run the callbacks if any rule changed.

        A rule that raises is logged and counts as unchanged. Returns the changed rules' names.
        """
        updated: list[str] = []
        for name in self.names():
            rule = self._rules[name]
            if not rule.system_supported():
                continue
            try:
                if rule.parse(policy):
                    updated.append(name)
            except Exception as exc:
                log.error(LOGGER, "rule_parse_failed", rule=name, error=repr(exc))
        if updated:
            log.event(LOGGER, "rules_updated", rules=",".join(updated))
            for callback in self._callbacks:
                callback()
        return tuple(updated)
