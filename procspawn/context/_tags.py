"""The tags of what a child sends its parent, one vocabulary for ``spawn``'s ranks
(and their Ray actors) and the pools' workers. No imports.

Every message is a tuple whose first item is its tag::

    (RESULT, value)                        the function (a rank's fn, a task) returned
    (RAISED, blob or None, text)           it raised: the exception packed (None if it
                                           cannot travel) and its traceback as text; the
                                           codec for both: ``_raised``
    (READY,) or (READY, index)             a pool worker is ready (its initializer ran);
                                           index: what its main module has (spawn,
                                           forkserver), for the parent to send by name
    (STARTED,)                             a pool worker took a task off its channel
    (INIT_FAILED, blob or None, text)      a pool worker's initializer raised; it exits
    (PROGRESS, n)                          a pool worker's task reported n steps done
                                           (``procspawn.progress(n)``)

A rank sends one message, RESULT or RAISED; a pool worker READY once, then STARTED, any
number of PROGRESS, and RESULT or RAISED per task.
"""

RESULT = "r"
RAISED = "e"
READY = "R"
STARTED = "s"
INIT_FAILED = "I"
PROGRESS = "p"

__all__ = ["INIT_FAILED", "PROGRESS", "RAISED", "READY", "RESULT", "STARTED"]
