"""The cleanup daemon of ``file_system`` segments: its holder table, its serving loop, its
client, and the address of this process tree's daemon (floor 1 of ``procspawn.sharing``)."""
