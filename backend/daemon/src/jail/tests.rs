use super::*;

#[test]
fn the_kernel_view_is_read_from_the_status_text() {
    let status = "Name:\tswitchyard\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t3\nSpeculation_Store_Bypass:\tthread vulnerable\n";
    assert_eq!(
        KernelView::parse(status),
        KernelView {
            no_new_privs: true,
            seccomp: 2,
            seccomp_filters: 3
        }
    );
    assert_eq!(
        KernelView::parse("NoNewPrivs:\t0\nSeccomp:\t0\n"),
        KernelView::default()
    );
}

#[test]
fn every_kind_has_its_policy() {
    for (kind, policy, filters) in [
        ("softgpu", Policy::SoftGpu, true),
        ("scratchpad", Policy::Scratchpad, true),
        ("vfio", Policy::Vfio, true),
        ("cuda", Policy::Cuda, false),
        ("newkind", Policy::Generic, false),
    ] {
        assert_eq!(Policy::for_kind(kind), policy);
        assert_eq!(policy.filters_syscalls(), filters, "{kind}");
    }
    // Every kind of the registry is known here (a new kind gets a policy of its own).
    for kind in switchyard_kinds::KINDS {
        assert_ne!(
            Policy::for_kind(kind.name()),
            Policy::Generic,
            "kind `{}` has no jail policy",
            kind.name()
        );
    }
}

#[test]
fn the_allow_lists_compile() {
    for policy in [Policy::SoftGpu, Policy::Scratchpad, Policy::Vfio] {
        let rules = syscalls::allow_list(policy).expect("rules");
        assert!(rules.contains_key(&libc::SYS_recvmsg), "{policy:?}");
        assert!(!rules.contains_key(&libc::SYS_connect), "{policy:?}");
        assert!(!rules.contains_key(&libc::SYS_ptrace), "{policy:?}");
        syscalls::compile(policy, false).expect("compiles");
    }
}
