"""The fused subclasses :func:`fuselm.patch` gives a model's modules: one factory, one cache.

A module is patched by swapping its ``__class__`` to a subclass of its own class with the same name,
module and qualname, so the object, its parameters, buffers, hooks and names do not change. Each
subclass is made once per request (HF class, mixin, class attributes) and kept, so patching twice
gives the same classes. The subclass records the HF class it extends (:data:`ORIGINAL`, what
``unpatch`` restores) and how to make it again (:data:`REBUILD`), so a patched module pickles
(``torch.save(model)``) as a reference to fuselm plus its HF class and loads patched.

A forward that must be HF's own with one global name seen differently (the attention's rotary call)
is a copy of HF's function: :func:`with_global`.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable

ORIGINAL = "_fuselm_original"  # class attribute of every fused subclass: the HF class it extends
REBUILD = "_fuselm_rebuild"  # class attribute: (function, args) that returns the subclass, for pickle

_SUBCLASSES: dict[tuple, type | None] = {}


def original_class(cls: type) -> type:
    """The HF class a fused subclass extends; any other class is its own original."""
    return cls.__dict__.get(ORIGINAL, cls)


def fused_subclass(original: type, mixin: type | None = None, make_forward: Callable[[], Callable | None] | None = None,
                   rebuild: tuple[Callable, tuple] | None = None, **attributes) -> type | None:
    """The subclass of ``original`` with ``mixin`` in front and the class ``attributes``; one per request.

    ``make_forward``, when given, is called on the first request only and gives the subclass's
    ``forward`` (None: no subclass can be made, and None is returned, now and on every later request).
    It must depend on ``original`` and ``attributes`` alone. ``rebuild``: a module-level function and
    its picklable arguments that give this subclass again (needed with ``make_forward``; by default
    this factory with the same request, whose mixin and attributes must then pickle).
    """
    key = (original, mixin, tuple(sorted(attributes.items())))
    if key not in _SUBCLASSES:
        namespace = dict(attributes)
        if make_forward is not None:
            namespace["forward"] = make_forward()
            if namespace["forward"] is None:
                _SUBCLASSES[key] = None
                return None
        bases = (mixin, original) if mixin is not None else (original,)
        _SUBCLASSES[key] = type(original.__name__, bases, {
            "__module__": original.__module__, "__qualname__": original.__qualname__,
            "__doc__": original.__doc__, "__reduce_ex__": _reduce_fused, ORIGINAL: original,
            REBUILD: rebuild or (_subclass_of, (original, mixin, key[2])), **namespace})
    return _SUBCLASSES[key]


def _subclass_of(original: type, mixin: type | None, attributes: tuple[tuple[str, object], ...]) -> type | None:
    return fused_subclass(original, mixin, **dict(attributes))


def _reduce_fused(self, protocol: int):
    """Pickle and copy a patched module as an instance of its fused subclass made again on load."""
    function, args = type(self).__dict__[REBUILD]
    return _new_instance, (function, args), self.__getstate__()


def _new_instance(function: Callable, args: tuple) -> object:
    """A bare instance of the fused subclass ``function(*args)`` gives (its state is set after this)."""
    try:
        cls = function(*args)
    except ValueError as error:
        cls = str(error)
    if not isinstance(cls, type):
        raise TypeError(f"fuselm cannot make the fused subclass of {args[0].__qualname__} again ({cls}; another "
                        "transformers version?): save with save_pretrained, or fuselm.unpatch before torch.save")
    return object.__new__(cls)


def with_global(func: Callable, name: str, value: object) -> Callable | None:
    """A copy of ``func`` that sees ``value`` for its global ``name``; None if its wrappers are unfamiliar.

    ``functools.wraps`` wrappers around ``func`` (transformers' ``deprecate_kwarg``, ...) are copied
    too, each holding the copy of what it wrapped, so their behaviour is kept. The copy's globals are
    a snapshot of the module's, taken now.
    """
    if not isinstance(func, types.FunctionType):
        return None
    inner = getattr(func, "__wrapped__", None)
    if inner is None:
        if name not in func.__code__.co_names:
            return None
        # No "__name__": tools that resolve globals through the module of that name (torch.compile's
        # guards) would read the module's own binding instead of this copy's.
        scope = {key: v for key, v in func.__globals__.items() if key != "__name__"}
        scope[name] = value
        clone = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    else:
        new_inner = with_global(inner, name, value)
        cells = func.__closure__ or ()
        holders = [i for i, cell in enumerate(cells) if _cell_holds(cell, inner)]
        if new_inner is None or len(holders) != 1:
            return None
        closure = tuple(types.CellType(new_inner) if i == holders[0] else cell for i, cell in enumerate(cells))
        clone = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, closure)
    clone.__kwdefaults__ = copy.copy(func.__kwdefaults__)
    clone.__dict__.update(func.__dict__)
    if inner is not None:
        clone.__wrapped__ = new_inner
    for attribute in ("__qualname__", "__doc__", "__module__", "__annotations__"):
        setattr(clone, attribute, getattr(func, attribute))
    return clone


def _cell_holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
