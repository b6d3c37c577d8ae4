"""Named implementations that a config selects by a string: advantage estimators, policy losses, KL estimators,
rollout engines, built-in verifiers, tool-call formats. Each registers itself where it is defined, with a
decorator (as verl's `register_adv_est`), so adding one touches its own module; the config holds the names as
plain strings, and the trainer's plan checks them here before any work starts."""

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fsdptrain.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, each with its declaration (`info`, a registry's own frozen dataclass: what an estimator
    needs, what a loss forces), from which the plan derives what a run builds for it."""

    def __init__(self, what: str, default_info: Any = None):
        self.what = what
        self.default_info = default_info
        self.entries: dict[str, T] = {}
        self.info: dict[str, Any] = {}

    def register(self, *names: str, info: Any = None) -> Callable[[T], T]:
        """A decorator that registers what it decorates under `names` (aliases share one entry), with its
        declaration (the registry's default where it declares nothing)."""

        def add(entry: T) -> T:
            for name in names:
                if name in self.entries:
                    raise ValueError(f"{self.what} {name!r} is registered twice")
                self.entries[name], self.info[name] = entry, info if info is not None else self.default_info
            return entry

        return add

    def __getitem__(self, name: str) -> T:
        return self.entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def names(self, **declared: Any) -> tuple[str, ...]:
        """The registered names, or those whose declaration has each of the given values."""
        return tuple(name for name in self.entries if all(getattr(self.info[name], k) == v for k, v in declared.items()))

    def check(self, key: str, name: str) -> None:
        """A ConfigError naming `key` unless `name` is registered."""
        if name not in self.entries:
            raise ConfigError(f"{key} must be one of {'|'.join(self.entries)}, got {name!r}")
