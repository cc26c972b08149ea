"""The checks each worker launch runs (ids are what the tests look up)."""

from sorl_megatron.bridge.families import FAMILIES

LOGIT_TOL = 1e-5  # float32; observed ~2e-7

DENSE_FAMILIES = ["qwen3", "llama"]

MP_CASES = [
    # logits vs transformers
    {"id": "logits/qwen2/tp2sp", "op": "logits", "model": "qwen2", "layout": "tp=2"},
    {"id": "logits/qwen2_tied/tp2nosp", "op": "logits", "model": "qwen2_tied", "layout": "tp=2,sp=0"},
    {"id": "logits/qwen3_moe/tp2sp", "op": "logits", "model": "qwen3_moe", "layout": "tp=2"},
    {"id": "logits/qwen3_moe/ep2", "op": "logits", "model": "qwen3_moe", "layout": "ep=2"},
    {"id": "logits/mixtral/ep2", "op": "logits", "model": "mixtral", "layout": "ep=2"},
    {"id": "logits/mixtral/tp2ep2", "op": "logits", "model": "mixtral", "layout": "tp=2,ep=2,etp=1"},
    {"id": "logits/qwen2/pp2", "op": "logits", "model": "qwen2", "layout": "pp=2"},
    {"id": "logits/qwen2_tied/pp2", "op": "logits", "model": "qwen2_tied", "layout": "pp=2"},
    {"id": "logits/mixtral/pp2", "op": "logits", "model": "mixtral", "layout": "pp=2"},
    {"id": "logits/qwen2_4l/pp2vpp2", "op": "logits", "model": "qwen2_4l", "layout": "pp=2,vpp=2"},
    {"id": "value/qwen2/tp2sp", "op": "value", "model": "qwen2", "layout": "tp=2"},
    {"id": "value/qwen2_tied/pp2", "op": "value", "model": "qwen2_tied", "layout": "pp=2"},
    # HF -> Megatron -> HF from sharded layouts
    {"id": "roundtrip/qwen3_moe/tp2", "op": "roundtrip", "model": "qwen3_moe", "layout": "tp=2"},
    {"id": "roundtrip/mixtral/ep2", "op": "roundtrip", "model": "mixtral", "layout": "ep=2"},
    {"id": "roundtrip/mixtral/tp2ep2", "op": "roundtrip", "model": "mixtral", "layout": "tp=2,ep=2,etp=1"},
    {"id": "roundtrip/qwen2_tied/pp2", "op": "roundtrip", "model": "qwen2_tied", "layout": "pp=2"},
    {"id": "roundtrip/qwen2_4l/pp2vpp2", "op": "roundtrip", "model": "qwen2_4l", "layout": "pp=2,vpp=2"},
    {"id": "buckets/qwen3_moe/ep2", "op": "buckets", "model": "qwen3_moe", "layout": "ep=2", "bucket_bytes": 30000},
    {"id": "fp8/mixtral/tp2", "op": "fp8", "model": "mixtral", "layout": "tp=2"},
    {"id": "from_config/mixtral/ep2", "op": "from_config", "model": "mixtral", "layout": "ep=2"},
    # Megatron checkpoints saved here, loaded here at another layout and by the 1-process run
    {"id": "save/qwen3_moe/tp2", "op": "save_ckpt", "model": "qwen3_moe", "layout": "tp=2", "ckpt": "ck_qwen3_moe_tp2"},
    {
        "id": "save/qwen2_4l/pp2vpp2",
        "op": "save_ckpt",
        "model": "qwen2_4l",
        "layout": "pp=2,vpp=2",
        "ckpt": "ck_qwen2_4l_vpp",
    },
    {"id": "save/mixtral/ep2", "op": "save_ckpt", "model": "mixtral", "layout": "ep=2", "ckpt": "ck_mixtral_ep2"},
    {
        "id": "load/qwen2_4l/vpp->tp2",
        "op": "load_ckpt",
        "model": "qwen2_4l",
        "layout": "tp=2",
        "ckpt": "ck_qwen2_4l_vpp",
    },
    {"id": "load/mixtral/ep2->tp2", "op": "load_ckpt", "model": "mixtral", "layout": "tp=2", "ckpt": "ck_mixtral_ep2"},
    # the shared-expert / MLA families (issue 20) at each 2-rank layout (4 ranks: tests/engine/conftest.py ws4)
    *[
        {"id": f"logits/{k}/{name}", "op": "logits", "model": k, "layout": layout}
        for k in ("deepseek_v3", "qwen2_moe", "glm4_moe")
        for name, layout in (("tp2sp", "tp=2"), ("ep2", "ep=2"), ("pp2", "pp=2"), ("tp2ep2", "tp=2,ep=2,etp=1"))
    ],
    {"id": "logits/deepseek_v3_yarn/tp2sp", "op": "logits", "model": "deepseek_v3_yarn", "layout": "tp=2"},
    {"id": "logits/deepseek_v3_no_q_lora/tp2sp", "op": "logits", "model": "deepseek_v3_no_q_lora", "layout": "tp=2"},
    {"id": "roundtrip/deepseek_v3/tp2", "op": "roundtrip", "model": "deepseek_v3", "layout": "tp=2"},
    {"id": "roundtrip/glm4_moe/ep2", "op": "roundtrip", "model": "glm4_moe", "layout": "ep=2"},
    {"id": "roundtrip/qwen2_moe/tp2", "op": "roundtrip", "model": "qwen2_moe", "layout": "tp=2"},
    # dense qwen3 (q/k norms, head_dim != hidden / heads) and llama
    *[
        case
        for k in DENSE_FAMILIES
        for case in (
            {"id": f"logits/{k}/tp2sp", "op": "logits", "model": k, "layout": "tp=2"},
            {"id": f"roundtrip/{k}/tp2", "op": "roundtrip", "model": k, "layout": "tp=2"},
        )
    ],
    # uneven pipeline stages (parallelism.first_stage_layers / last_stage_layers): 3 layers = 1 + 2
    {"id": "logits/deepseek_v3_3l/pp2-first1", "op": "uneven_logits", "model": "deepseek_v3_3l",
     "layout": "pp=2,first_stage_layers=1", "expect_layers": [[[0]], [[1, 2]]]},
    {"id": "logits/qwen2_4l/pp2-last1", "op": "uneven_logits", "model": "qwen2_4l",  # tied embeddings
     "layout": "pp=2,last_stage_layers=1", "expect_layers": [[[0, 1, 2]], [[3]]]},
    {"id": "roundtrip/deepseek_v3_3l/pp2-first1", "op": "roundtrip", "model": "deepseek_v3_3l",
     "layout": "pp=2,first_stage_layers=1"},
    {"id": "save/deepseek_v3_3l/pp2-first1", "op": "save_ckpt", "model": "deepseek_v3_3l",
     "layout": "pp=2,first_stage_layers=1", "ckpt": "ck_deepseek_v3_3l_pp2_first1"},
    {"id": "load/deepseek_v3_3l/pp2-first1->ep2", "op": "load_ckpt", "model": "deepseek_v3_3l", "layout": "ep=2",
     "ckpt": "ck_deepseek_v3_3l_pp2_first1"},
    {
        "id": "save/deepseek_v3/ep2",
        "op": "save_ckpt",
        "model": "deepseek_v3",
        "layout": "ep=2",
        "ckpt": "ck_deepseek_v3_ep2",
    },
]

NEW_FAMILIES = ["deepseek_v3", "qwen2_moe", "glm4_moe"]

KINDS = ["qwen2", "qwen2_tied", "qwen3_moe", "mixtral", "qwen2_4l", *NEW_FAMILIES, *DENSE_FAMILIES]
KINDS += [k for k in FAMILIES if k not in KINDS]  # every registered family: logits and round trip at ws1

SINGLE_CASES = (
    [{"id": f"logits/{k}/ws1", "op": "logits", "model": k, "layout": ""} for k in KINDS]
    + [{"id": f"roundtrip/{k}/ws1", "op": "roundtrip", "model": k, "layout": ""} for k in KINDS]
    + [
        {
            "id": "roundtrip/qwen3_moe/ws1-sharded",
            "op": "roundtrip",
            "model": "qwen3_moe",
            "layout": "",
            "max_shard_bytes": 60000,
        },
        {"id": "value/qwen2/ws1", "op": "value", "model": "qwen2", "layout": ""},
        {"id": "value/qwen2_tied/ws1", "op": "value", "model": "qwen2_tied", "layout": ""},
        {
            "id": "roundtrip/qwen2_bf16/ws1",
            "op": "roundtrip",
            "model": "qwen2_bf16",
            "layout": "",
            "expect_dtype": "bfloat16",
        },  # fp32 on CPU, exported back in the source's bf16 by default
        {"id": "roundtrip/mixtral/ws1-bf16", "op": "roundtrip", "model": "mixtral", "layout": "", "dtype": "bfloat16"},
        {"id": "from_config/qwen3_moe/ws1", "op": "from_config", "model": "qwen3_moe", "layout": ""},
        {"id": "buckets/qwen2_tied/ws1", "op": "buckets", "model": "qwen2_tied", "layout": "", "bucket_bytes": 20000},
        {"id": "fp8/qwen3_moe/ws1", "op": "fp8", "model": "qwen3_moe", "layout": ""},
        {
            "id": "missing_weight/qwen2",
            "op": "missing_weight",
            "model": "qwen2",
            "layout": "",
            "drop": "model.layers.1.mlp.up_proj.weight",
        },
        {
            "id": "load/qwen3_moe/tp2->ws1",
            "op": "load_ckpt",
            "model": "qwen3_moe",
            "layout": "",
            "ckpt": "ck_qwen3_moe_tp2",
        },
        {
            "id": "load/qwen2_4l/vpp->ws1",
            "op": "load_ckpt",
            "model": "qwen2_4l",
            "layout": "",
            "ckpt": "ck_qwen2_4l_vpp",
        },
        {"id": "load/mixtral/ep2->ws1", "op": "load_ckpt", "model": "mixtral", "layout": "", "ckpt": "ck_mixtral_ep2"},
        {"id": "compat_probes", "op": "compat_probes"},
        {"id": "local_attention", "op": "local_attention"},
        *[{"id": f"family_fixes/{k}", "op": "family_fixes", "model": k} for k in (*NEW_FAMILIES, "deepseek_v3_yarn")],
        {"id": "logits/deepseek_v3_yarn/ws1", "op": "logits", "model": "deepseek_v3_yarn", "layout": ""},
        {"id": "logits/deepseek_v3_no_q_lora/ws1", "op": "logits", "model": "deepseek_v3_no_q_lora", "layout": ""},
        {"id": "value/deepseek_v3/ws1", "op": "value", "model": "deepseek_v3", "layout": ""},  # a critic on MLA
        *[{"id": f"fp8/{k}/ws1", "op": "fp8", "model": k, "layout": ""} for k in NEW_FAMILIES],
        {
            "id": "load/deepseek_v3/ep2->ws1",
            "op": "load_ckpt",
            "model": "deepseek_v3",
            "layout": "",
            "ckpt": "ck_deepseek_v3_ep2",
        },
        {"id": "spec_selection", "op": "spec_selection", "model": "qwen3_moe"},
        {"id": "pipeline_split_grid", "op": "pipeline_split_grid"},
        {"id": "load/deepseek_v3_3l/pp2-first1->ws1", "op": "load_ckpt", "model": "deepseek_v3_3l", "layout": "",
         "ckpt": "ck_deepseek_v3_3l_pp2_first1"},
    ]
)
