"""Shared segments and the arrays over them: the mapping, the strategies that make and
share segments, recycled segments, slabs, array layout and the public array helpers
(floor 2 of ``procspawn.sharing``)."""
