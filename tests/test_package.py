import importlib


def test_packages_import_under_their_own_names():
    sm = importlib.import_module("sorl_megatron")
    sk = importlib.import_module("sorl_kernels")
    assert sm.__version__
    assert sk.__name__ == "sorl_kernels"
