"""How a process of procspawn's starts: the default start method, the parent-death guard,
the early-output ``Popen``, procspawn's fork server, and starting one child under any start
method with its output on the parent's pipes (the floor below the rest of ``context``)."""
