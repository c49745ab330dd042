"""The toolkit's dynamic NPU call sites: what `npu_schema.discover` cannot resolve alone, and what each stands for."""
from typing import Dict, Tuple

# The few dynamic sites: (file, function, expression) -> (the NPU paths it stands for, why).
# Calls through such a site are checked against those paths; a site missing here fails
# test_every_npu_call_is_resolved, an entry that matches nothing fails test_allowlist_is_current.
ALLOW: Dict[Tuple[str, str, str], Tuple[Tuple[str, ...], str]] = {
    ("overlap/backends/device.py", "DeviceBackend.mod", "getattr(torch, self.device_type)"):
        (("torch.npu",), "torch.cuda or torch.npu by the backend's device type (same stream / event API); "
                         "the CUDA side is torch's own"),
    ("microbatch/planning/cache.py", "_device_name", "getattr(torch, backend.device_type, None)"):
        (("torch.npu",), "the device module of the current backend, for get_device_name"),
    ("overlap/host_sync.py", "HostSyncs._patch", "getattr(owner, name, None)"):
        (("torch.npu.synchronize",), "the synchronize being counted, called as it was: torch.npu's among torch's "
                                     "and the toolkit's own"),
    ("overlap/host_sync.py", "HostSyncs._patch", "original if own else None"):
        (("torch.npu.synchronize",), "the same synchronize, kept to be put back when counting ends"),
    ("launch/memory.py", "available", "getattr(torch, device.type)"):
        (("torch.npu",), "the device module of the rank's device, for mem_get_info"),
}
