"""What carries messages between processes: descriptor passing over UNIX sockets,
Connection and Pipe, the queues, the start-up message (floor 4 of ``procspawn.sharing``)."""
