"""What a message looks like on the wire: segment handles, the ndarray reducers and the
pickler (floor 3 of ``procspawn.sharing``)."""
