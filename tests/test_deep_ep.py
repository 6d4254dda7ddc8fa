"""The `deep_ep` stand-in: `install()` makes DeepEP's import lines resolve to epcomm."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_lines_of_deepep_users_resolve():
    """In a fresh interpreter: the import forms DeepEP's users write, after `install()`."""
    code = textwrap.dedent("""
        import epcomm.deep_ep
        assert epcomm.deep_ep.install() is epcomm.deep_ep
        import deep_ep
        from deep_ep import Buffer, ElasticBuffer, EPHandle, EventOverlap, Config, topk_idx_t
        from deep_ep.buffers.legacy import Buffer as LegacyBuffer
        from deep_ep.buffers.elastic import ElasticBuffer as Elastic
        from deep_ep.utils.event import EventOverlap as Event, EventHandle
        from deep_ep.utils.envs import get_physical_domain_size
        import epcomm, epcomm.legacy, torch
        assert deep_ep is epcomm.deep_ep and Buffer is LegacyBuffer is epcomm.legacy.Buffer
        assert ElasticBuffer is Elastic is epcomm.ElasticBuffer and EPHandle is epcomm.EPHandle
        assert EventOverlap is Event is epcomm.EventOverlap and topk_idx_t is torch.int64
        assert Config is epcomm.legacy.Config and EventHandle is epcomm.EventHandle
        assert deep_ep.get_logical_domain_size is epcomm.get_logical_domain_size
        assert epcomm.deep_ep.install() is deep_ep  # a second call is harmless
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_install_refuses_to_replace_a_real_deep_ep():
    code = textwrap.dedent("""
        import sys, types
        sys.modules["deep_ep"] = types.ModuleType("deep_ep")
        import epcomm.deep_ep
        try:
            epcomm.deep_ep.install()
        except RuntimeError as error:
            assert "already imported" in str(error), error
            print("refused")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "refused", run.stderr
