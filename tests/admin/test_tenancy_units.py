"""The parts of tenancy the server tests cannot reach one by one: the namespace function, key
matching, the launcher's key flags (test_fault_tenancy.py runs them in the real server)."""

from __future__ import annotations

import pytest

from server_patch.tenancy.flags import apply_api_key_flags, take_api_key_flags
from server_patch.tenancy.keys import ApiKeys, load
from server_patch.tenancy.namespace import PREFIX, key_identity, namespace


def test_without_a_key_or_a_salt_the_namespace_is_the_tenant() -> None:
    assert namespace(None, None, None) is None  # mlx-vlm's own default tenant applies
    assert namespace(None, "team", None) == "team"


def test_every_part_separates_and_no_secret_is_in_the_name() -> None:
    key = key_identity(b"sk-secret")
    names = {namespace(k, t, s) for k in (None, key, key_identity(b"other"))
             for t in (None, "team", "team2") for s in (None, "salt", "salt2")}
    assert len(names) == 27  # distinct triples, distinct namespaces
    assert not any("sk-secret" in (n or "") or '"salt":"salt' in (n or "") for n in names)  # digests only


def test_a_tenant_cannot_pose_as_a_derived_namespace() -> None:
    forged = namespace(None, "team", "salt")
    assert forged is not None and forged.startswith(PREFIX)
    assert namespace(None, forged, None) != forged  # a plain tenant that looks like one is wrapped


def test_a_key_matches_as_bearer_or_x_api_key_and_nothing_else() -> None:
    keys = ApiKeys((b"k1", b"k2"))
    assert keys.identity(b"Bearer k1", None) == key_identity(b"k1")
    assert keys.identity(None, b"k2") == key_identity(b"k2")
    for auth, plain in ((None, None), (b"Bearer k3", None), (b"bearer k1", None), (b"k1", None),
                        (b"Bearer k1 ", None), (None, b"k"), (b"Bearer ", b"")):
        assert keys.identity(auth, plain) is None, (auth, plain)


def test_keys_load_from_the_variable_and_the_file(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# ops\nfile-key\n\n  spaced-key  \n")
    loaded = load({"APC_API_KEYS": "a, b", "APC_API_KEY_FILE": str(path), "MLX_VLM_SERVER_API_KEY": "m"})
    assert loaded == ApiKeys((b"a", b"b", b"file-key", b"spaced-key", b"m"), upstream=b"m")
    assert load({}) is None
    with pytest.raises(ValueError, match="holds no key"):
        load({"APC_API_KEYS": ""})


def test_the_launcher_takes_its_key_flags_out_of_mlx_vlms_arguments(tmp_path) -> None:
    args = ["--model", "m", "--api-key", "k1", "--api-key=k2", "--api-key-file", "keys", "--port", "1"]
    assert take_api_key_flags(args) == (["--model", "m", "--port", "1"], ["k1", "k2"], "keys")
    (tmp_path / "keys").write_text("k3\n")
    env: dict[str, str] = {}
    rest = apply_api_key_flags(["--api-key", "k1", "--api-key-file", str(tmp_path / "keys")], env, patched=True)
    assert rest == [] and env == {"APC_API_KEYS": "k1", "APC_API_KEY_FILE": str(tmp_path / "keys")}
    with pytest.raises(SystemExit, match="comma"):
        apply_api_key_flags(["--api-key", "a,b"], {}, patched=True)
    with pytest.raises(SystemExit, match="needs a value"):
        take_api_key_flags(["--api-key"])


def test_stock_mlx_vlm_keeps_its_one_key_and_refuses_more() -> None:
    assert apply_api_key_flags(["--api-key", "k"], {}, patched=False) == ["--api-key", "k"]
    for args, env in ((["--api-key", "a", "--api-key", "b"], {}), (["--api-key-file", "f"], {}),
                      ([], {"APC_API_KEYS": "k"})):
        with pytest.raises(SystemExit, match="stock mlx-vlm"):
            apply_api_key_flags(args, env, patched=False)


def test_apcctl_serve_passes_keys_in_the_environment_never_on_the_command_line(tmp_path, tiny_model_dir) -> None:
    import click

    from apcctl.commands.serve import api_key_env, server_spec

    key_file = tmp_path / "keys"
    key_file.write_text("k3\n")
    pairs = api_key_env(("k1", "k2"), key_file)
    assert pairs == ["APC_API_KEYS=k1,k2", f"APC_API_KEY_FILE={key_file.resolve()}"]
    spec, _ = server_spec("keys-unit", str(tiny_model_dir), 8123, None, None, tuple(pairs), None, ())
    assert spec.env["APC_API_KEYS"] == "k1,k2" and not any("k1" in arg for arg in spec.argv)
    with pytest.raises(click.BadParameter, match="comma"):
        api_key_env(("a,b",), None)
