"""The ``mpmd`` placement: one compiled program per stage and kind of action, each holding only the
parameter groups it reads, dispatched by the host in a program's order (:mod:`.engine` is its
surface; :mod:`.memory` is what the dry run reads to size it)."""
