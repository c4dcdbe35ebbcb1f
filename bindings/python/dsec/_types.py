"""The native result types the package hands out, and the argument types its signatures name."""

from __future__ import annotations

from typing import Union

from . import _dsec

ExecResult = _dsec.ExecResult
FnCallRequest = _dsec.FnCallRequest
FnCallResult = _dsec.FnCallResult
SandboxInfo = _dsec.SandboxInfo
ProcessInfo = _dsec.ProcessInfo
ProcessOutput = _dsec.ProcessOutput
SessionInfo = _dsec.SessionInfo
SleepResult = _dsec.SleepResult
SnapshotResult = _dsec.SnapshotResult
NodeInfo = _dsec.NodeInfo
CachedLayer = _dsec.CachedLayer
ImageInfo = _dsec.ImageInfo
ImageLayerInfo = _dsec.ImageLayerInfo
Resources = _dsec.Resources

Size = Union[int, str]
BytesLike = Union[bytes, bytearray, memoryview, str]
