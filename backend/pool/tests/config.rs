//! The configuration file: parsing, the embedded default, and every validation error with the
//! key path it names.
#![forbid(unsafe_code)]

mod common;
use common::KINDS;
use serde_json::json;
use switchyard_pool::{ConfigProblem, DeviceShape, ErrorKind, Inventory, PoolConfig, PoolError};

const TWO_BOARDS: &str = r#"
[[boards]]
id = "gpu0"
vram = "64M"
queues = 2

[[boards]]
id = "gpu1"
vram = "64M"
queues = 2

[[pools]]
name = "default"
boards = ["gpu0", "gpu1"]
"#;

/// The shape of board `id` as its kind checked it.
fn shape_of(c: &PoolConfig, id: &str) -> DeviceShape {
    let (inv, _, _) = Inventory::from_config(c, KINDS).expect("inventory");
    inv.board(id).expect("board").shape
}

/// Parses `text`, expecting a refusal; returns the error and its message.
fn refused(text: &str) -> (PoolError, String) {
    let e = PoolConfig::from_toml(text, KINDS).expect_err("configuration must be refused");
    let msg = e.to_string();
    assert!(
        msg.starts_with(|c: char| c.is_ascii_uppercase()),
        "sentence case: {msg}"
    );
    assert_eq!(e.kind(), ErrorKind::Invalid, "{msg}");
    (e, msg)
}

/// Expects a semantic refusal at `key` and returns its problem and message.
fn refused_at(text: &str, key: &str) -> (ConfigProblem, String) {
    let (e, msg) = refused(text);
    match e {
        PoolError::Config {
            key: k, problem, ..
        } => {
            assert_eq!(k, key, "{msg}");
            assert!(msg.contains(&format!("`{key}`")), "{msg}");
            (problem, msg)
        }
        other => panic!("expected a Config error at {key}, got {other:?}"),
    }
}

#[test]
fn parses_the_full_shape() {
    let c = PoolConfig::from_toml(
        r#"
[daemon]
control_socket = "/tmp/sy/control.sock"
state_dir = "/tmp/sy/state"
endpoint_dir = "/tmp/sy/ep"

[[boards]]
id = "gpu0"
model = "softgpu"
vram = "256M"
queues = 4
irq = "msi"
vram_mmap = false
partitions = [ { id = "gpu0.p0", vram = "128M", queues = 2 }, { id = "gpu0.p1", vram = 134217728, queues = 2 } ]

[[boards]]
id = "gpu1"
vram = "256m"
queues = 4
irq = "msi"
vram_mmap = false
partitions = [ { id = "gpu1.p0", vram = "128M", queues = 2 }, { id = "gpu1.p1", vram = "131072K", queues = 2 } ]

[[pools]]
name = "parts"
boards = ["gpu0", "gpu1"]

[[endpoints]]
id = "vm1"
pool = "parts"
min_vram = "64M"
min_queues = 1

[[endpoints]]
id = "vm2"
device = "gpu1.p1"
socket = "/tmp/vm2.sock"
"#,
        KINDS,
    )
    .expect("valid");
    assert_eq!(
        c.daemon.store_path().to_str(),
        Some("/tmp/sy/state/pool.redb")
    );
    // The model and partitions are the pool's; every other key is the kind's option.
    assert_eq!(c.boards[0].model, "softgpu");
    assert_eq!(c.boards[1].model, "softgpu", "the default model");
    assert_eq!(c.boards[0].options["vram"], "256M");
    assert_eq!(c.boards[0].options["irq"], "msi");
    assert_eq!(c.boards[0].options["vram_mmap"], false);
    assert_eq!(c.boards[0].options.len(), 4, "{:?}", c.boards[0].options);
    // The kind's check makes them canonical.
    let shape = shape_of(&c, "gpu1");
    assert_eq!((shape.memory(), shape.queues()), (256 << 20, 4));
    assert_eq!(shape.options["vram"], 256u64 << 20);
    assert_eq!(shape.option_text("irq").as_deref(), Some("msi"));
    assert_eq!(shape, shape_of(&c, "gpu0"), "256m and 256M are one size");
    assert_eq!(c.boards[0].partitions[1].vram.0, 128 << 20);
    assert_eq!(c.boards[1].partitions[1].vram.0, 128 << 20);
    assert_eq!(c.endpoints[0].min_vram.map(|s| s.0), Some(64 << 20));
    assert_eq!(c.endpoints[1].device.as_deref(), Some("gpu1.p1"));
    // The TOML it writes reads back the same.
    assert_eq!(
        PoolConfig::from_toml(&c.to_toml(), KINDS).expect("round trip"),
        c
    );
}

#[test]
fn defaults_fill_the_optional_keys() {
    let c = PoolConfig::from_toml("[[boards]]\nid = \"g\"\n", KINDS).expect("minimal");
    let b = &c.boards[0];
    assert_eq!(b.model, "softgpu");
    assert!(b.options.is_empty() && b.partitions.is_empty());
    // The kind fills in its defaults.
    let shape = shape_of(&c, "g");
    assert_eq!((shape.memory(), shape.queues()), (64 << 20, 2));
    assert_eq!(
        serde_json::Value::Object(shape.options),
        json!({"vram": 64 << 20, "queues": 2, "irq": "msix", "vram_mmap": true, "vram_reset": "zero"})
    );
    assert_eq!(
        c.daemon.endpoint_dir.to_str(),
        Some("/run/switchyard/endpoints")
    );
    assert_eq!(
        c.daemon.control_socket.to_str(),
        Some("/run/switchyard/control.sock")
    );
    assert_eq!(
        PoolConfig::from_toml("", KINDS).expect("empty"),
        PoolConfig {
            boards: vec![],
            pools: vec![],
            ..PoolConfig::default()
        }
    );
}

#[test]
fn the_embedded_default_is_two_softgpus_in_one_pool() {
    let c = PoolConfig::default();
    c.validate(KINDS).expect("the default is valid");
    let ids: Vec<&str> = c.boards.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(ids, ["gpu0", "gpu1"]);
    for b in &c.boards {
        let shape = shape_of(&c, &b.id);
        assert_eq!(shape.model, "softgpu");
        assert_eq!((shape.memory(), shape.queues()), (64 << 20, 2));
    }
    assert_eq!(c.pools.len(), 1);
    assert_eq!(c.pools[0].name, "default");
    assert_eq!(c.pools[0].boards, ["gpu0", "gpu1"]);
    assert!(c.endpoints.is_empty());
    let text = c.to_toml();
    assert!(text.contains("vram = \"64M\""), "{text}");
    assert_eq!(PoolConfig::from_toml(&text, KINDS).expect("round trip"), c);
}

#[test]
fn values_the_parser_refuses_name_their_key_and_line() {
    let text = TWO_BOARDS.replace(
        "queues = 2\n\n[[pools]]",
        "queues = 2\nmodel = 3\n\n[[pools]]",
    );
    let (e, msg) = refused(&text);
    assert!(
        matches!(&e, PoolError::Config { key, line: Some(11), problem: ConfigProblem::Value(m) }
            if key == "boards[1].model" && m.contains("integer")),
        "{e:?}"
    );
    assert!(msg.contains("`boards[1].model` (line 11)"), "{msg}");

    let cases: &[(&str, &str, &str)] = &[
        ("[[boards]]\nvram = \"1M\"", "boards[0]", "id"),
        (
            "[[boards]]\nid = \"g\"\nmodel = 3",
            "boards[0].model",
            "integer",
        ),
        (
            "[[boards]]\nid = \"g\"\npartitions = [{ id = \"p\", vram = \"1M\", queues = 1, x = 1 }]",
            "boards[0].partitions[0].x",
            "x",
        ),
        (
            "[[boards]]\nid = \"g\"\npartitions = [{ id = \"p\", vram = \"12X\", queues = 1 }]",
            "boards[0].partitions[0].vram",
            "12X",
        ),
        ("[daemon]\nstate = \"/x\"", "daemon.state", "state"),
        (
            "[[pools]]\nname = \"p\"\nboards = \"gpu0\"",
            "pools[0].boards",
            "sequence",
        ),
        (
            "[[endpoints]]\nid = \"e\"\nmin_queues = 1.5",
            "endpoints[0].min_queues",
            "float",
        ),
        ("[[endpoint]]\nid = \"e\"", "endpoint", "endpoint"),
    ];
    for (text, key, needle) in cases {
        let (e, msg) = refused(text);
        match &e {
            PoolError::Config {
                key: k,
                problem: ConfigProblem::Value(m),
                ..
            } => {
                assert_eq!(k, key, "{text}: {msg}");
                assert!(m.contains(needle), "{text}: {msg}");
            }
            other => panic!("{text}: expected a value error at {key}, got {other:?}"),
        }
    }
}

#[test]
fn the_kind_checks_its_options_at_their_key_and_line() {
    // gpu1's vram, on line 9 of the file.
    let text = TWO_BOARDS.replace(
        "id = \"gpu1\"\nvram = \"64M\"",
        "id = \"gpu1\"\nvram = \"12X\"",
    );
    let (e, msg) = refused(&text);
    assert!(
        matches!(&e, PoolError::Config { key, line: Some(9), problem: ConfigProblem::Kind { model, message } }
            if key == "boards[1].vram" && model == "softgpu" && message.contains("12X")),
        "{e:?}"
    );
    assert!(
        msg.contains("`boards[1].vram` (line 9): softgpu: "),
        "{msg}"
    );

    let cases: &[(&str, &str, &str)] = &[
        ("queues = \"four\"", "queues", "four"),
        ("queues = -1", "queues", "-1"),
        ("queues = 9", "queues", "outside 1 to 8"),
        ("irq = \"intx\"", "irq", "intx"),
        ("vram = -5", "vram", "-5"),
        ("vram = \"99999999999G\"", "vram", "99999999999G"),
        ("vram = \"3M\"", "vram", "not a power of two"),
        ("vram = \"512K\"", "vram", "outside 1 MiB"),
        ("vram_mmap = 3", "vram_mmap", "on/off"),
        ("vram_reset = \"wipe\"", "vram_reset", "wipe"),
        (
            "colour = \"red\"",
            "colour",
            "unknown option; known: vram, queues",
        ),
    ];
    for (line, option, needle) in cases {
        let text = format!("[[boards]]\nid = \"g\"\n{line}\n");
        let key = format!("boards[0].{option}");
        let (p, msg) = refused_at(&text, &key);
        assert!(
            matches!(&p, ConfigProblem::Kind { model, message } if model == "softgpu" && message.contains(needle)),
            "{line}: {msg}"
        );
        assert!(msg.contains(&format!("`{key}` (line 3)")), "{line}: {msg}");
    }
    // An unknown model is reported at `model`, with the known ones.
    let (p, msg) = refused_at(
        "[[boards]]\nid = \"g\"\nmodel = \"rtx\"\n",
        "boards[0].model",
    );
    assert_eq!(
        p,
        ConfigProblem::UnknownModel {
            model: "rtx".into(),
            known: "softgpu, vfio".into()
        }
    );
    assert!(
        msg.ends_with("(line 3): unknown model \"rtx\"; the models are softgpu, vfio"),
        "{msg}"
    );
    // The options are the kind's: another kind refuses the softgpu's.
    let (p, msg) = refused_at(
        "[[boards]]\nid = \"g\"\nmodel = \"vfio\"\nhost = \"00:04.0\"\nvram = \"64M\"\n",
        "boards[0].vram",
    );
    assert!(
        matches!(&p, ConfigProblem::Kind { model, message } if model == "vfio" && message.contains("unknown option")),
        "{msg}"
    );
}

#[test]
fn bad_toml_is_a_syntax_error_with_its_line() {
    let (e, msg) = refused("[[boards]]\nid = \"g\"\nvram = \n");
    assert!(
        matches!(e, PoolError::ConfigSyntax { line: Some(3), .. }),
        "{e:?}"
    );
    assert!(
        msg.starts_with("Cannot parse the configuration (line 3)"),
        "{msg}"
    );
}

#[test]
fn partitions_are_checked_against_their_board() {
    let board = |parts: &str| {
        format!("[[boards]]\nid = \"gpu0\"\nvram = \"256M\"\nqueues = 4\npartitions = [{parts}]\n")
    };
    // Each partition's options (the board's, with its own VRAM and queues) are checked by
    // the kind, at the partition's key.
    let (p, msg) = refused_at(
        &board(r#"{ id = "a", vram = "96M", queues = 2 }"#),
        "boards[0].partitions[0].vram",
    );
    assert!(
        matches!(&p, ConfigProblem::Kind { message, .. } if message.contains("not a power of two")),
        "{msg}"
    );
    let (p, msg) = refused_at(
        &board(r#"{ id = "a", vram = "64M", queues = 2 }, { id = "b", vram = "64M", queues = 0 }"#),
        "boards[0].partitions[1].queues",
    );
    assert!(
        matches!(&p, ConfigProblem::Kind { message, .. } if message.contains("0 queues")),
        "{msg}"
    );
    // A partition has the board's other options.
    let c = PoolConfig::from_toml(
        &board(r#"{ id = "a", vram = "64M", queues = 2 }"#)
            .replace("queues = 4", "queues = 4\nirq = \"msi\""),
        KINDS,
    )
    .expect("a partition");
    let (inv, _, _) = Inventory::from_config(&c, KINDS).expect("inventory");
    let a = inv.device("a").expect("partition").shape;
    assert_eq!((a.memory(), a.queues()), (64 << 20, 2));
    assert_eq!(a.option_text("irq").as_deref(), Some("msi"));
    // Sums fit in the board.
    let (p, msg) = refused_at(
        &board(
            r#"{ id = "a", vram = "128M", queues = 2 }, { id = "b", vram = "256M", queues = 2 }"#,
        ),
        "boards[0].partitions",
    );
    assert!(
        matches!(p, ConfigProblem::PartitionsExceedBoard { what: "VRAM", .. }),
        "{msg}"
    );
    assert!(
        msg.contains("384 MiB of VRAM but the board has 256 MiB"),
        "{msg}"
    );
    let (p, msg) = refused_at(
        &board(r#"{ id = "a", vram = "64M", queues = 3 }, { id = "b", vram = "64M", queues = 2 }"#),
        "boards[0].partitions",
    );
    assert!(
        matches!(
            p,
            ConfigProblem::PartitionsExceedBoard { what: "queues", .. }
        ),
        "{msg}"
    );
    assert!(msg.contains("5 of queues but the board has 4"), "{msg}");
    // Exactly full is fine (positive control).
    PoolConfig::from_toml(
        &board(
            r#"{ id = "a", vram = "128M", queues = 2 }, { id = "b", vram = "128M", queues = 2 }"#,
        ),
        KINDS,
    )
    .expect("partitions filling the board");
}

#[test]
fn ids_are_checked_and_unique_across_every_kind() {
    let (p, msg) = refused_at("[[boards]]\nid = \"gpu 0\"\n", "boards[0].id");
    assert_eq!(p, ConfigProblem::BadId("gpu 0".into()), "{msg}");
    let long = "g".repeat(65);
    refused_at(&format!("[[boards]]\nid = \"{long}\"\n"), "boards[0].id");
    refused_at("[[boards]]\nid = \"\"\n", "boards[0].id");
    PoolConfig::from_toml(&format!("[[boards]]\nid = \"{}\"\n", "g".repeat(64)), KINDS)
        .expect("64 characters");
    refused_at(
        "[[boards]]\nid = \"g\"\npartitions = [{ id = \"a/b\", vram = \"1M\", queues = 1 }]",
        "boards[0].partitions[0].id",
    );
    refused_at(
        &format!("{TWO_BOARDS}[[pools]]\nname = \"a b\"\n"),
        "pools[1].name",
    );
    refused_at(
        &format!("{TWO_BOARDS}[[endpoints]]\nid = \"\"\npool = \"default\"\n"),
        "endpoints[0].id",
    );

    // One namespace: board/board, board/partition, pool/board, endpoint/pool, endpoint/endpoint.
    let (p, msg) = refused_at(
        &format!("{TWO_BOARDS}[[boards]]\nid = \"gpu0\"\n"),
        "boards[2].id",
    );
    assert_eq!(
        p,
        ConfigProblem::DuplicateId {
            id: "gpu0".into(),
            first: "boards[0].id".into()
        },
        "{msg}"
    );
    refused_at(
        &format!(
            "{TWO_BOARDS}[[boards]]\nid = \"gpu2\"\npartitions = [{{ id = \"gpu1\", vram = \"1M\", queues = 1 }}]\n"
        ),
        "boards[2].partitions[0].id",
    );
    refused_at(
        &format!("{TWO_BOARDS}[[pools]]\nname = \"gpu1\"\n"),
        "pools[1].name",
    );
    refused_at(
        &format!("{TWO_BOARDS}[[endpoints]]\nid = \"default\"\npool = \"default\"\n"),
        "endpoints[0].id",
    );
    let (p, _) = refused_at(
        &format!(
            "{TWO_BOARDS}[[endpoints]]\nid = \"vm\"\npool = \"default\"\n[[endpoints]]\nid = \"vm\"\npool = \"default\"\n"
        ),
        "endpoints[1].id",
    );
    assert_eq!(
        p,
        ConfigProblem::DuplicateId {
            id: "vm".into(),
            first: "endpoints[0].id".into()
        }
    );
}

#[test]
fn pools_name_existing_boards_once() {
    let (p, msg) = refused_at(
        &TWO_BOARDS.replace("[\"gpu0\", \"gpu1\"]", "[\"gpu0\", \"gpu1\", \"gpu9\"]"),
        "pools[0].boards[2]",
    );
    assert_eq!(p, ConfigProblem::UnknownBoard("gpu9".into()));
    assert!(
        msg.ends_with("`pools[0].boards[2]`: unknown board \"gpu9\""),
        "{msg}"
    );
    let (p, _) = refused_at(
        &format!("{TWO_BOARDS}[[pools]]\nname = \"other\"\nboards = [\"gpu1\"]\n"),
        "pools[1].boards[0]",
    );
    assert_eq!(
        p,
        ConfigProblem::BoardInTwoPools {
            board: "gpu1".into(),
            pool: "default".into()
        }
    );
    refused_at(
        &TWO_BOARDS.replace("[\"gpu0\", \"gpu1\"]", "[\"gpu0\", \"gpu0\"]"),
        "pools[0].boards[1]",
    );
    let (p, _) = refused_at(
        "[[boards]]\nid = \"g\"\npartitions = [{ id = \"g.p\", vram = \"1M\", queues = 1 }]\n[[pools]]\nname = \"p\"\nboards = [\"g.p\"]\n",
        "pools[0].boards[0]",
    );
    assert_eq!(p, ConfigProblem::PartitionInPool("g.p".into()));
}

#[test]
fn boards_that_differ_only_in_a_host_setting_are_one_pool() {
    let text = TWO_BOARDS.replacen("id = \"gpu1\"\n", "id = \"gpu1\"\nspin = 50\n", 1);
    let c = PoolConfig::from_toml(&text, KINDS).expect("a host setting is not the guest's view");
    assert_eq!(
        shape_of(&c, "gpu0").difference(&shape_of(&c, "gpu1")),
        None,
        "{:?} vs {:?}",
        shape_of(&c, "gpu0"),
        shape_of(&c, "gpu1")
    );
    assert_ne!(shape_of(&c, "gpu0").options, shape_of(&c, "gpu1").options);
}

#[test]
fn pools_must_be_homogeneous() {
    let with_gpu1 =
        |line: &str| TWO_BOARDS.replacen("id = \"gpu1\"\n", &format!("id = \"gpu1\"\n{line}\n"), 1);
    let cases: &[(&str, &str)] = &[
        ("vram_mmap = false", "vram_mmap (false vs true)"),
        ("irq = \"msi\"", "irq (msi vs msix)"),
        ("vram_reset = \"keep\"", "vram_reset (keep vs zero)"),
    ];
    for (line, diff) in cases {
        let (p, msg) = refused_at(&with_gpu1(line), "pools[0]");
        assert_eq!(
            p,
            ConfigProblem::NotHomogeneous {
                board: "gpu1".into(),
                reference: "gpu0".into(),
                difference: (*diff).into(),
            },
            "{msg}"
        );
    }
    let (_, msg) = refused_at(
        &TWO_BOARDS.replacen(
            "vram = \"64M\"\nqueues = 2\n\n[[pools]]",
            "vram = \"128M\"\nqueues = 2\n\n[[pools]]",
            1,
        ),
        "pools[0]",
    );
    assert_eq!(
        msg,
        "Invalid configuration at `pools[0]`: board \"gpu1\" differs from \"gpu0\" in memory (128 MiB vs 64 MiB); a pool's boards must be identical"
    );
    let (_, msg) = refused_at(
        &TWO_BOARDS.replacen("queues = 2\n\n[[pools]]", "queues = 4\n\n[[pools]]", 1),
        "pools[0]",
    );
    assert!(msg.contains("in queues (4 vs 2)"), "{msg}");

    // Partition layouts: count, then sizes.
    let parted = |a: &str, b: &str| {
        format!(
            "[[boards]]\nid = \"a\"\nvram = \"256M\"\nqueues = 4\npartitions = [{a}]\n\
             [[boards]]\nid = \"b\"\nvram = \"256M\"\nqueues = 4\npartitions = [{b}]\n\
             [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n"
        )
    };
    let (_, msg) = refused_at(
        &parted(
            r#"{ id = "a0", vram = "128M", queues = 2 }, { id = "a1", vram = "128M", queues = 2 }"#,
            r#"{ id = "b0", vram = "128M", queues = 2 }"#,
        ),
        "pools[0]",
    );
    assert!(
        msg.contains("differs from \"a\" in partition layout (1 partitions vs 2)"),
        "{msg}"
    );
    let (_, msg) = refused_at(
        &parted(
            r#"{ id = "a0", vram = "128M", queues = 2 }, { id = "a1", vram = "128M", queues = 2 }"#,
            r#"{ id = "b0", vram = "128M", queues = 2 }, { id = "b1", vram = "64M", queues = 2 }"#,
        ),
        "pools[0]",
    );
    assert!(
        msg.contains("in partitions[1].memory (64 MiB vs 128 MiB)"),
        "{msg}"
    );
    let (_, msg) = refused_at(
        &parted(
            r#"{ id = "a0", vram = "128M", queues = 2 }"#,
            r#"{ id = "b0", vram = "128M", queues = 1 }"#,
        ),
        "pools[0]",
    );
    assert!(msg.contains("in partitions[0].queues (1 vs 2)"), "{msg}");
    // Identical layouts with other ids are one pool (positive control).
    PoolConfig::from_toml(
        &parted(
            r#"{ id = "a0", vram = "128M", queues = 2 }"#,
            r#"{ id = "b0", vram = "128M", queues = 2 }"#,
        ),
        KINDS,
    )
    .expect("identical layouts");
}

#[test]
fn endpoints_name_one_existing_target() {
    let ep = |body: &str| format!("{TWO_BOARDS}[[endpoints]]\nid = \"vm1\"\n{body}\n");
    let (p, _) = refused_at(&ep("pool = \"default\"\ndevice = \"gpu0\""), "endpoints[0]");
    assert!(matches!(p, ConfigProblem::Placement(_)));
    let (p, _) = refused_at(&ep("min_queues = 1"), "endpoints[0]");
    assert!(matches!(p, ConfigProblem::Placement(_)));
    let (p, _) = refused_at(&ep("pool = \"gpus\""), "endpoints[0].pool");
    assert_eq!(p, ConfigProblem::UnknownPool("gpus".into()));
    let (p, _) = refused_at(&ep("device = \"gpu7\""), "endpoints[0].device");
    assert_eq!(p, ConfigProblem::UnknownDevice("gpu7".into()));
    let (p, _) = refused_at(
        &ep("device = \"gpu0\"\nsocket = \"rel.sock\""),
        "endpoints[0].socket",
    );
    assert!(matches!(p, ConfigProblem::SocketPath(_)));
    let (p, _) = refused_at(
        &format!(
            "{}[[endpoints]]\nid = \"vm2\"\ndevice = \"gpu0\"\n",
            ep("device = \"gpu0\"")
        ),
        "endpoints[1].device",
    );
    assert_eq!(
        p,
        ConfigProblem::DeviceNamedTwice {
            device: "gpu0".into(),
            first: "endpoints[0]".into()
        }
    );
    let parted = "[[boards]]\nid = \"g\"\npartitions = [{ id = \"g.p\", vram = \"1M\", queues = 1 }]\n\
                  [[endpoints]]\nid = \"vm\"\ndevice = \"g\"\n";
    let (p, _) = refused_at(parted, "endpoints[0].device");
    assert_eq!(p, ConfigProblem::NotLeasable("g".into()));
    PoolConfig::from_toml(&parted.replace("device = \"g\"", "device = \"g.p\""), KINDS)
        .expect("a partition");
}

#[test]
fn a_missing_file_is_reported_with_its_path() {
    let e = PoolConfig::load(std::path::Path::new("/nonexistent/pool.toml"), KINDS)
        .expect_err("missing");
    assert!(matches!(e, PoolError::ConfigRead(..)));
    assert!(e.to_string().contains("/nonexistent/pool.toml"), "{e}");
    assert!(
        std::error::Error::source(&e).is_some(),
        "the io error is the source"
    );
}

#[test]
fn passthrough_boards_are_checked_by_their_kind() {
    let c = PoolConfig::from_toml(
        "[[boards]]\nid = \"vf0\"\nmodel = \"vfio\"\nhost = \"01:10.2\"\nbars = \"mmap\"\n",
        KINDS,
    )
    .expect("a passthrough board");
    let shape = shape_of(&c, "vf0");
    assert_eq!(shape.model, "vfio");
    assert_eq!(shape.option_text("host").as_deref(), Some("0000:01:10.2"));
    assert_eq!(shape.option_text("bars").as_deref(), Some("mmap"));
    assert_eq!((shape.memory(), shape.queues()), (0, 0));
    assert!(!shape.profile.movable && !shape.profile.partitionable);
    // The TOML round trip keeps host and bars.
    let again = PoolConfig::from_toml(&c.to_toml(), KINDS).expect("round trip");
    assert_eq!(again, c);

    let (p, msg) = refused_at(
        "[[boards]]\nid = \"vf0\"\nmodel = \"vfio\"\n",
        "boards[0].host",
    );
    assert!(matches!(p, ConfigProblem::Kind { .. }), "{msg}");
    assert!(msg.contains("required"), "{msg}");
    let (_, msg) = refused_at(
        "[[boards]]\nid = \"vf0\"\nmodel = \"vfio\"\nhost = \"zz\"\n",
        "boards[0].host",
    );
    assert!(msg.contains("not a PCI address"), "{msg}");
    let (p, msg) = refused_at(
        "[[boards]]\nid = \"vf0\"\nmodel = \"vfio\"\nhost = \"00:04.0\"\npartitions = [{ id = \"p\", vram = \"1M\", queues = 1 }]\n",
        "boards[0].partitions",
    );
    assert_eq!(p, ConfigProblem::NotPartitionable("vfio".into()));
    assert!(msg.contains("a vfio board cannot be partitioned"), "{msg}");
    let (_, msg) = refused_at(
        "[[boards]]\nid = \"g\"\nhost = \"00:04.0\"\n",
        "boards[0].host",
    );
    assert!(msg.contains("softgpu: unknown option"), "{msg}");
    // One board per device, however its address is written.
    let (p, msg) = refused_at(
        "[[boards]]\nid = \"a\"\nmodel = \"vfio\"\nhost = \"0000:00:04.0\"\n\
         [[boards]]\nid = \"b\"\nmodel = \"vfio\"\nhost = \"00:04.0\"\n",
        "boards[1].host",
    );
    assert_eq!(
        p,
        ConfigProblem::ResourceTaken {
            resource: "0000:00:04.0".into(),
            board: "a".into()
        }
    );
    assert!(
        msg.ends_with(
            "(line 8): board \"a\" already holds \"0000:00:04.0\"; a device is one board only"
        ),
        "{msg}"
    );
    // A pool of passthrough boards: their addresses differ (which device, not what it looks
    // like), their BAR policy must not.
    let pair = |bars_b: &str| {
        format!(
            "[[boards]]\nid = \"a\"\nmodel = \"vfio\"\nhost = \"00:04.0\"\n\
             [[boards]]\nid = \"b\"\nmodel = \"vfio\"\nhost = \"00:05.0\"\n{bars_b}\n\
             [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n"
        )
    };
    PoolConfig::from_toml(&pair(""), KINDS).expect("two devices, one pool");
    let (problem, msg) = refused_at(&pair("bars = \"mmap\""), "pools[0]");
    assert_eq!(
        problem,
        ConfigProblem::NotHomogeneous {
            board: "b".into(),
            reference: "a".into(),
            difference: "bars (mmap vs trap)".into(),
        },
        "{msg}"
    );
    // Nor does a pool mix kinds.
    let (problem, msg) = refused_at(
        "[[boards]]\nid = \"a\"\nmodel = \"vfio\"\nhost = \"00:04.0\"\n[[boards]]\nid = \"b\"\n\
         [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n",
        "pools[0]",
    );
    assert!(
        matches!(&problem, ConfigProblem::NotHomogeneous { difference, .. } if difference == "model (softgpu vs vfio)"),
        "{msg}"
    );
}

/// A `[daemon]` table with `line`, before two boards (a file `refused_at` can check).
fn daemon(line: &str) -> String {
    format!("[daemon]\n{line}\n{TWO_BOARDS}")
}

/// An absolute path of exactly `len` bytes.
fn path_of(len: usize) -> String {
    format!("/{}", "d".repeat(len - 1))
}

#[test]
fn daemon_paths_are_absolute_without_nul_bytes() {
    for key in ["control_socket", "state_dir", "endpoint_dir"] {
        let at = format!("daemon.{key}");
        for (value, needle) in [
            ("\"\"", "empty"),
            ("\"run/x\"", "relative"),
            ("\"./x\"", "relative"),
            ("\"/run/a\\u0000b\"", "NUL"),
        ] {
            let (p, msg) = refused_at(&daemon(&format!("{key} = {value}")), &at);
            assert!(matches!(p, ConfigProblem::Path(_)), "{msg}");
            assert!(msg.contains(needle), "{key} = {value}: {msg}");
        }
    }
    // An endpoint's own socket has no NUL byte either.
    let (p, msg) = refused_at(
        &format!(
            "{TWO_BOARDS}[[endpoints]]\nid = \"vm1\"\npool = \"default\"\nsocket = \"/run/a\\u0000.sock\"\n"
        ),
        "endpoints[0].socket",
    );
    assert!(matches!(p, ConfigProblem::Path(_)), "{msg}");
    assert!(msg.contains("NUL"), "{msg}");
}

#[test]
fn sockets_fit_a_unix_socket_path() {
    // The control socket: 107 bytes fit, 108 do not.
    PoolConfig::from_toml(
        &daemon(&format!("control_socket = \"{}\"", path_of(107))),
        KINDS,
    )
    .expect("107 bytes");
    let (p, msg) = refused_at(
        &daemon(&format!("control_socket = \"{}\"", path_of(108))),
        "daemon.control_socket",
    );
    assert!(matches!(p, ConfigProblem::Path(_)), "{msg}");
    assert!(msg.contains("108 bytes") && msg.contains("107"), "{msg}");

    // The endpoint directory must leave room for `/<id>.sock` of a one-character id ...
    PoolConfig::from_toml(
        &daemon(&format!("endpoint_dir = \"{}\"", path_of(100))),
        KINDS,
    )
    .expect("100 bytes: `/x.sock` fits");
    for len in [101, 120, 300] {
        let (p, msg) = refused_at(
            &daemon(&format!("endpoint_dir = \"{}\"", path_of(len))),
            "daemon.endpoint_dir",
        );
        assert!(matches!(p, ConfigProblem::Path(_)), "{msg}");
        assert!(msg.contains("107"), "{msg}");
    }
    // ... and every endpoint of the file gets its socket: `<endpoint_dir>/<id>.sock`.
    let dir = path_of(60);
    let ep = |id: &str, extra: &str| {
        format!(
            "[daemon]\nendpoint_dir = \"{dir}\"\n{TWO_BOARDS}[[endpoints]]\nid = \"{id}\"\npool = \"default\"\n{extra}"
        )
    };
    PoolConfig::from_toml(&ep(&"v".repeat(41), ""), KINDS).expect("60 + 1 + 41 + 5 = 107 bytes");
    let (p, msg) = refused_at(&ep(&"v".repeat(42), ""), "endpoints[0].id");
    assert!(matches!(p, ConfigProblem::Path(_)), "{msg}");
    assert!(
        msg.contains("108 bytes") && msg.contains("daemon.endpoint_dir"),
        "{msg}"
    );
    // A socket of its own is checked instead.
    PoolConfig::from_toml(&ep(&"v".repeat(42), "socket = \"/run/vm.sock\"\n"), KINDS)
        .expect("its own socket");
    let (p, msg) = refused_at(
        &ep("vm1", &format!("socket = \"{}\"\n", path_of(108))),
        "endpoints[0].socket",
    );
    assert!(matches!(p, ConfigProblem::Path(_)), "{msg}");
}

#[test]
fn descriptor_budgets_have_defaults_and_ranges() {
    let c = PoolConfig::from_toml("", KINDS).expect("empty");
    assert_eq!(
        (c.daemon.fds_per_endpoint, c.daemon.fd_reserve),
        (1024, 256)
    );
    assert_eq!(c.daemon, switchyard_pool::DaemonConfig::default());
    let c = PoolConfig::from_toml(
        "[daemon]\nfds_per_endpoint = 64\nfd_reserve = 65536\n",
        KINDS,
    )
    .expect("the bounds");
    assert_eq!(
        (c.daemon.fds_per_endpoint, c.daemon.fd_reserve),
        (64, 65536)
    );
    assert_eq!(
        PoolConfig::from_toml(&c.to_toml(), KINDS).expect("round trip"),
        c
    );
    for key in ["fds_per_endpoint", "fd_reserve"] {
        let at = format!("daemon.{key}");
        for value in [0u64, 63, 65537, 1 << 31] {
            let (p, msg) = refused_at(&daemon(&format!("{key} = {value}")), &at);
            assert_eq!(
                p,
                ConfigProblem::OutOfRange {
                    value,
                    min: 64,
                    max: 65536
                },
                "{msg}"
            );
            assert!(msg.contains("expected 64 to 65536"), "{msg}");
        }
        let (e, msg) = refused(&daemon(&format!("{key} = -1")));
        assert!(
            matches!(&e, PoolError::Config { key: k, problem: ConfigProblem::Value(_), .. } if *k == at),
            "{msg}"
        );
    }
}

#[test]
fn events_retention_has_defaults_and_ranges() {
    let c = PoolConfig::from_toml("", KINDS).expect("empty");
    assert_eq!(c.daemon.events_keep, 100_000);
    assert_eq!(c.daemon.events_max_age, switchyard_pool::Age(30 * 86_400));
    let c = PoolConfig::from_toml(
        "[daemon]\nevents_keep = 1\nevents_max_age = \"12h\"\n",
        KINDS,
    )
    .expect("in range");
    assert_eq!(c.daemon.events_keep, 1);
    assert_eq!(c.daemon.events_max_age.0, 12 * 3600);
    assert_eq!(
        PoolConfig::from_toml(&c.to_toml(), KINDS).expect("round trip"),
        c
    );
    let (p, msg) = refused_at(&daemon("events_keep = 0"), "daemon.events_keep");
    assert_eq!(
        p,
        ConfigProblem::OutOfRange {
            value: 0,
            min: 1,
            max: u64::MAX
        },
        "{msg}"
    );
    for (value, needle) in [
        ("\"59s\"", "59s is out of range; expected 1m to 36500d"),
        ("0", "0s is out of range"),
        ("\"36501d\"", "36501d is out of range"),
    ] {
        let (p, msg) = refused_at(
            &daemon(&format!("events_max_age = {value}")),
            "daemon.events_max_age",
        );
        assert!(matches!(p, ConfigProblem::Value(_)), "{msg}");
        assert!(msg.contains(needle), "{msg}");
    }
    for value in ["\"2w\"", "\"-1d\"", "-5", "\"1.5d\""] {
        let (e, msg) = refused(&daemon(&format!("events_max_age = {value}")));
        assert!(
            matches!(&e, PoolError::Config { key, problem: ConfigProblem::Value(_), .. } if key == "daemon.events_max_age"),
            "{value}: {msg}"
        );
    }
}

#[test]
fn the_migration_idle_timeout_has_a_default_and_a_range() {
    let c = PoolConfig::from_toml("", KINDS).expect("empty");
    assert_eq!(c.daemon.migration_idle_timeout, switchyard_pool::Age(60));
    let c = PoolConfig::from_toml("[daemon]\nmigration_idle_timeout = \"2s\"\n", KINDS)
        .expect("in range");
    assert_eq!(c.daemon.migration_idle_timeout.0, 2);
    assert_eq!(
        PoolConfig::from_toml(&c.to_toml(), KINDS).expect("round trip"),
        c
    );
    for (value, needle) in [
        ("0", "0s is out of range; expected 1s to 1d"),
        ("\"25h\"", "25h is out of range"),
    ] {
        let (p, msg) = refused_at(
            &daemon(&format!("migration_idle_timeout = {value}")),
            "daemon.migration_idle_timeout",
        );
        assert!(matches!(p, ConfigProblem::Value(_)), "{msg}");
        assert!(msg.contains(needle), "{msg}");
    }
}
