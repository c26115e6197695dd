//! The nf_tables UAPI (`include/uapi/linux/netfilter/nf_tables.h`) that is not particular to
//! one expression: message types, the attributes of tables, chains, rules, sets, elements and
//! the generation, object flags, and data and verdict encodings. Each expression's attributes
//! and constants live in its own file under `wire/expr/`. Names drop the `NFT_MSG_` / `NFTA_`
//! prefixes (`NFTA_SET_ELEM_LIST_ELEMENTS` is `ELEM_LIST_ELEMENTS`); values are the header's.

// nf_tables message types.
pub const NEWTABLE: u16 = 0;
pub const GETTABLE: u16 = 1;
pub const DELTABLE: u16 = 2;
pub const NEWCHAIN: u16 = 3;
pub const GETCHAIN: u16 = 4;
pub const DELCHAIN: u16 = 5;
pub const NEWRULE: u16 = 6;
pub const GETRULE: u16 = 7;
pub const DELRULE: u16 = 8;
pub const NEWSET: u16 = 9;
pub const GETSET: u16 = 10;
pub const DELSET: u16 = 11;
pub const NEWSETELEM: u16 = 12;
pub const GETSETELEM: u16 = 13;
pub const DELSETELEM: u16 = 14;
pub const NEWGEN: u16 = 15;
pub const GETGEN: u16 = 16;
pub const GEN_ID: u16 = 1;

// Attributes.
pub const TABLE_NAME: u16 = 1;
pub const TABLE_FLAGS: u16 = 2;
pub const TABLE_USERDATA: u16 = 6;
pub const TABLE_OWNER: u16 = 7;
pub const CHAIN_TABLE: u16 = 1;
pub const CHAIN_NAME: u16 = 3;
pub const CHAIN_HOOK: u16 = 4;
pub const CHAIN_POLICY: u16 = 5;
pub const CHAIN_TYPE: u16 = 7;
pub const CHAIN_USERDATA: u16 = 12;
pub const HOOK_HOOKNUM: u16 = 1;
pub const HOOK_PRIORITY: u16 = 2;
pub const RULE_TABLE: u16 = 1;
pub const RULE_CHAIN: u16 = 2;
pub const RULE_HANDLE: u16 = 3;
pub const RULE_EXPRESSIONS: u16 = 4;
pub const LIST_ELEM: u16 = 1;
pub const EXPR_NAME: u16 = 1;
pub const EXPR_DATA: u16 = 2;
pub const SET_TABLE: u16 = 1;
pub const SET_NAME: u16 = 2;
pub const SET_FLAGS: u16 = 3;
pub const SET_KEY_TYPE: u16 = 4;
pub const SET_KEY_LEN: u16 = 5;
pub const SET_DATA_TYPE: u16 = 6;
pub const SET_DATA_LEN: u16 = 7;
pub const SET_USERDATA: u16 = 13;
pub const SET_DESC: u16 = 9;
pub const SET_DESC_SIZE: u16 = 1;
pub const SET_DESC_CONCAT: u16 = 2;
pub const SET_FIELD_LEN: u16 = 1;
pub const SET_ID: u16 = 10;
pub const ELEM_LIST_TABLE: u16 = 1;
pub const ELEM_LIST_SET: u16 = 2;
pub const ELEM_LIST_ELEMENTS: u16 = 3;
pub const ELEM_KEY: u16 = 1;
pub const ELEM_DATA: u16 = 2;
pub const ELEM_USERDATA: u16 = 6;
pub const ELEM_KEY_END: u16 = 10;

// Data (`NFTA_DATA_*`) and verdicts (`NFTA_VERDICT_*`).
pub const DATA_VALUE: u16 = 1;
pub const DATA_VERDICT: u16 = 2;
pub const VERDICT_CODE: u16 = 1;
pub const VERDICT_CHAIN: u16 = 2;

/// `NFT_TABLE_F_OWNER` (kernel 5.12): the table belongs to the netlink socket that created (or
/// claimed) it; other sockets get EPERM on every change to it.
pub const TABLE_F_OWNER: u32 = 0x2;
/// `NFT_TABLE_F_PERSIST` (kernel 6.9): an owned table survives its owner, orphaned (the owner
/// flag is dropped), and another socket can claim it by updating it with the owner flag.
pub const TABLE_F_PERSIST: u32 = 0x4;
/// The flags of a table owned by the process programming it ([`Table::owned`]).
pub const TABLE_F_OWNED: u32 = TABLE_F_OWNER | TABLE_F_PERSIST;

/// `NFT_SET_MAP`.
pub const SET_F_MAP: u32 = 0x8;
/// `NFT_SET_INTERVAL`, `NFT_SET_TIMEOUT`, `NFT_SET_EVAL` (dynamic), `NFT_SET_CONCAT`.
pub const SET_F_INTERVAL: u32 = 0x4;
pub const SET_F_TIMEOUT: u32 = 0x10;
pub const SET_F_EVAL: u32 = 0x20;
pub const SET_F_CONCAT: u32 = 0x80;
/// `NFT_DATA_VERDICT`: the data type of verdict maps.
pub const DATA_TYPE_VERDICT: u32 = 0xffff_ff00;
/// The kernel reports `sizeof(struct nft_verdict)` as a verdict map's data length.
pub const VERDICT_DATA_LEN: u32 = 16;

pub const NF_DROP: i32 = 0;
pub const NF_ACCEPT: i32 = 1;
pub const NFT_CONTINUE: i32 = -1;
pub const NFT_RETURN: i32 = -5;
pub const NFT_JUMP: i32 = -3;
pub const NFT_GOTO: i32 = -4;

/// `NFPROTO_IPV4`, `NFPROTO_IPV6` (`linux/netfilter.h`): the families of our tables.
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

/// `enum nf_inet_hooks` (`linux/netfilter.h`): the hooks a base chain attaches to.
pub const NF_INET_PRE_ROUTING: u32 = 0;
pub const NF_INET_LOCAL_IN: u32 = 1;
pub const NF_INET_FORWARD: u32 = 2;
pub const NF_INET_LOCAL_OUT: u32 = 3;
pub const NF_INET_POST_ROUTING: u32 = 4;
