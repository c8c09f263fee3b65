"""Wire formats: the fast path's control header and frames, and the Open Inference Protocol."""

from splitserve.protocol.header import HEADER_SIZE, Flags, Header, Kind, RequestClass, unpack_header

__all__ = ["HEADER_SIZE", "Flags", "Header", "Kind", "RequestClass", "unpack_header"]
