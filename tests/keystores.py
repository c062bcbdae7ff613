"""A self-signed broker key and certificate made with the JDK's `keytool` (for the SASL_SSL
listener of `stream_rl.kafka.listener`; used by tests, not shipped)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def make_keystore(d: Path, password: str, sans: str = "ip:127.0.0.1,dns:localhost") -> tuple[Path, Path]:
    """An EC key and certificate whose SAN is `sans`, as a PKCS12 keystore and its PEM certificate
    (what clients trust: `ssl.ca.location`)."""
    keytool = shutil.which("keytool")
    assert keytool, "keytool (the JDK's) is not on PATH: the local broker needs a JDK 17 anyway"
    store, pem = d / "broker.p12", d / "ca.pem"
    common = ["-keystore", str(store), "-storepass", password, "-alias", "broker"]
    subprocess.run(
        [keytool, "-genkeypair", *common, "-keyalg", "EC", "-groupname", "secp256r1", "-validity", "2",
         "-dname", "CN=localhost", "-ext", f"SAN={sans}", "-storetype", "PKCS12", "-keypass", password],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        [keytool, "-exportcert", *common, "-rfc", "-file", str(pem)], check=True, capture_output=True
    )
    return store, pem
