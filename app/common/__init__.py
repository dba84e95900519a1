"""Small shared pieces every stage may use, standard library only: the error an options object raises
(``options.OptionError``), walking groups of rows (``groups.group_slices``), loading a user's ``file.py:function``
(``plugins.load_function``), what a run is made of as comparable digests (``identity``: file digests, a checkpoint
folder's cheap fingerprint, the keys two identities differ in).

May import: nothing of ``app``.
Exports: ``OptionError``, ``group_slices``, ``load_function``.
"""

from app.common.groups import group_slices
from app.common.options import OptionError
from app.common.plugins import load_function

__all__ = ["OptionError", "group_slices", "load_function"]
