//! The kernel side: lowering the ruleset to netlink, applying, reading back.
