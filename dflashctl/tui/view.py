"""What the screens may use of the app, typed: `LiveScreen.view` instead of untyped `self.app`.

The screens cannot import `DflashApp` (it imports them); they depend on this Protocol, which the
app satisfies, and on `LiveScreen`, the base of every screen the app's coalesced tick redraws.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar, runtime_checkable

from textual.screen import Screen

from dflashctl.fleet import HostHandle
from dflashctl.monitor.plan import RunShape
from dflashctl.monitor.state import RunState

ResultT = TypeVar("ResultT")


@runtime_checkable
class AppView(Protocol):
    """The app as its screens (and their self-ticking widgets) see it: the hosts and groups,
    the clock, the dirty set, the redraw, navigation."""

    @property
    def hosts(self) -> Mapping[str, HostHandle]: ...

    @property
    def groups(self) -> Mapping[str, tuple[str, ...]]:
        """Groups (multi-node runs): name -> its nodes' host names, node 0 first."""
        ...

    @property
    def dirty(self) -> set[str]:
        """Hosts whose state changed since the last redraw (screens add to it)."""
        ...

    @property
    def clock(self) -> Callable[[], float]:
        """The app's wall clock (tests fix it): what every "N ago" counts from."""
        ...

    def flush(self) -> None: ...

    def shape_for(self, host: str) -> RunShape: ...

    def open_host(self, host: str) -> None: ...

    def open_group(self, group: str) -> None: ...


class LiveScreen(Screen[ResultT]):
    """A screen redrawn by the app's tick: `refresh_view` gets every host's latest state."""

    @property
    def view(self) -> AppView:
        app = self.app
        if not isinstance(app, AppView):
            raise TypeError(f"{type(self).__name__} runs only inside DflashApp, not {app!r}")
        return app

    def request_redraw(self, host: str | None = None) -> None:
        """Mark `host` changed (if given) and redraw on the next turn of the event loop."""
        view = self.view
        if host is not None:
            view.dirty.add(host)
        self.app.call_later(view.flush)

    def refresh_view(
        self, states: Mapping[str, RunState], now: float, dirty: Iterable[str]
    ) -> None:
        """Redraw from `states`; `dirty` names the hosts whose state changed since the last tick."""
